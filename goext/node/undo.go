package node

// undo is the list of what an assembly opened, closed in reverse order
// (the last opened first) when a later step fails, or by the component's
// Close.
type undo struct {
	fns []func()
}

// push records how to close what was just opened.
func (u *undo) push(f func()) { u.fns = append(u.fns, f) }

// run closes everything recorded, last first, and forgets it (a second
// run does nothing).
func (u *undo) run() {
	for i := len(u.fns) - 1; i >= 0; i-- {
		u.fns[i]()
	}
	u.fns = nil
}
