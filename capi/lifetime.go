package main

/*
#include "kvbm.h"
*/
import "C"

import "sync"

// lifetime orders a handle's calls with its free. An engine may free a
// handle while another of its threads still calls it (a shutdown racing a
// step): without an order the free closes what the call is using, and the
// call panics (poisoning the library) or reads freed memory. Every handle
// type embeds one: a call holds it shared for its whole run (acquire), and
// free marks it closed, so that later calls fail at once with a "freed"
// error, then waits for the calls in progress before releasing anything.
type lifetime struct {
	mu    sync.Mutex
	idle  *sync.Cond // broadcast when calls drops to 0 while freed
	calls int
	freed bool
}

// enter starts a call; false once the handle is being freed.
func (l *lifetime) enter() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.freed {
		return false
	}
	l.calls++
	return true
}

// exit ends a call started by enter.
func (l *lifetime) exit() {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.calls--; l.calls == 0 && l.idle != nil {
		l.idle.Broadcast()
	}
}

// close refuses every later call; false when another free got there first
// (that one releases the handle).
func (l *lifetime) close() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.freed {
		return false
	}
	l.freed = true
	return true
}

// drain waits until no call is in progress; only after close.
func (l *lifetime) drain() {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.idle == nil {
		l.idle = sync.NewCond(&l.mu)
	}
	for l.calls > 0 {
		l.idle.Wait()
	}
}

func (l *lifetime) life() *lifetime { return l }

// guarded is a handle type: a pointer to a struct that embeds lifetime.
type guarded interface{ life() *lifetime }

func nop() {}

// acquire is the first step of an export taking a handle: the library is
// healthy, hd names a T, and the handle is not being freed. done ends the
// hold and must be deferred (even on error, where it does nothing).
func acquire[T guarded](hd C.uint64_t) (v T, done func(), err error) {
	if v, err = live[T](hd); err != nil {
		return v, nop, err
	}
	if !v.life().enter() {
		var zero T
		return zero, nop, errorf(statusState, "handle %d was freed", uint64(hd))
	}
	return v, v.life().exit, nil
}

// freeHandle is the body of every *_free export: it refuses new calls,
// runs interrupt (which unblocks calls that would otherwise wait long, e.g.
// a side-channel handshake; nil: none), waits for the calls in progress,
// deletes the handle and then releases what it holds. A handle freed twice,
// even at once, is released once; an unknown one is ignored.
func freeHandle[T guarded](hd C.uint64_t, interrupt func(T), release func(T)) {
	v, err := handle[T](hd)
	if err != nil || !v.life().close() {
		return
	}
	if interrupt != nil {
		interrupt(v)
	}
	v.life().drain()
	deleteHandle(hd)
	release(v)
}
