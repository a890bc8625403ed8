package node

import "errors"

// Kind classifies an error of the assembly for the caller (the C ABI maps
// each to a status code).
type Kind int

const (
	// KindInvalid: a bad argument or input (the default of an error
	// without a kind).
	KindInvalid Kind = iota
	// KindConfig: an invalid configuration; the message names the variable.
	KindConfig
	// KindIO: file system, network, device memory.
	KindIO
	// KindState: a call in the wrong state.
	KindState
)

// Error carries a Kind with the error it classifies; its message is the
// wrapped error's.
type Error struct {
	Kind Kind
	Err  error
}

func (e *Error) Error() string { return e.Err.Error() }
func (e *Error) Unwrap() error { return e.Err }

// withKind classifies err (nil stays nil); the outermost kind wins.
func withKind(k Kind, err error) error {
	if err == nil {
		return nil
	}
	return &Error{Kind: k, Err: err}
}

// KindOf reports err's kind; ok is false for an error the assembly did not
// classify.
func KindOf(err error) (k Kind, ok bool) {
	var e *Error
	if errors.As(err, &e) {
		return e.Kind, true
	}
	return KindInvalid, false
}
