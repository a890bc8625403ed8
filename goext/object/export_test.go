package object

// ResetKeyWarning lets a test see the once-per-process warning about a MAC
// key that is no secret again.
func ResetKeyWarning() { warnedKeyNotSecret.Store(false) }
