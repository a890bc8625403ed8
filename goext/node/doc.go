// Package node is kvbm's front door: it builds a worker (NewWorker), a
// leader (NewLeader), a consolidator (NewConsolidator) and a page store
// (NewPageStore) from one config.Config plus explicit dependencies (Deps:
// the G1 copier, the G4 stores' tuning, the clock, the logger, the
// Registry). The C ABI (capi) only converts its arguments and handles and
// calls it; Go tests and benchmarks use the same door without cgo.
//
// # Ownership
//
// Each component owns what its constructor opened and releases it in its
// Close, the last opened first; a constructor that fails closes what it had
// opened the same way, so a failure leaves nothing behind (no G4 store
// reference, no bound port, no open file, no rank 0 fingerprint):
//
//	worker:       G1 copier → G4 store → worker (owns the copier from here) → rank 0 fingerprint → side channel
//	leader:       consolidator → G4 store → leader → metrics endpoint
//	page store:   G4 store → page store
//
// What components of one process share lives in one Registry (see its
// doc for the list); Process() is the C ABI's, tests make their own.
//
// # Lock order
//
// Across packages, locks are taken in this order and never the reverse:
//
//  1. the C ABI's handle lifetime (capi/lifetime.go), held for a whole call;
//  2. leader.Leader's lock, held by every leader call (match, step, the
//     background loop's commit);
//  3. the events.Sink the leader was given, called under the leader's
//     lock: the consolidator's tracker lock (consolidator.Consolidator
//     Publish), the tier event buffer's (events.Buffer); then the
//     consolidator's publishers' queues;
//  4. the G4 store's own locks (registry, upload queue), which the leader
//     also calls under its lock; the Registry's g4mu is taken only when a
//     store opens or closes, never under the leader's lock except by
//     Leader.SetG4Fingerprint, which holds no leader lock while it opens.
//
// Nothing below calls up: the consolidator never calls the leader, a store
// never calls its registry's owner. TestLockOrder runs a leader, its
// consolidator and its tier event buffer from several goroutines under
// -race to keep it so.
package node
