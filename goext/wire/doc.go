// Package wire is the leader⇄worker side channel (design §2): the handshake that
// sizes the host and disk tiers from what every tensor-parallel rank reports,
// operations that are not tied to an engine step (a plan.Step broadcast to
// every rank, completed by per-rank acks), and heartbeats that notice a rank
// that died or stopped answering.
//
// Per-step plans do not travel here: the engine ships the leader's encoded
// plan to every worker itself (vLLM pickles the connector metadata to all
// ranks, TensorRT-LLM broadcasts it). This channel carries what the engine
// does not: start-up, background operations and liveness.
//
// # Ends and owners
//
// Coordinator is the scheduler side's end (Listen, Handshake, Broadcast,
// DeadRanks, SuspectRanks); Member is one rank's end (Connect). Neither is
// driven from outside Go: the leader (goext/leader) takes a Coordinator as
// its leader.Broadcaster and runs its background operations over it in its
// own goroutine, and a worker's Member executes operations straight into
// worker.Run (RunOn; ExpectSizes checks the leader's tier sizes against the
// rank's own). goext/node creates them (node.ListenSideChannel, and
// node.NewWorker with a WorkerSpec.SideChannel); the C ABI converts the
// "side_channel" object of the kvbm_leader_new / kvbm_worker_new options into
// those calls, and kvbm_leader_wait_ready runs the handshake in slices.
//
// # Sockets
//
// The leader binds, workers connect, as in the reference:
//
//	leader PUB  bind tcp://DYN_KVBM_LEADER_ZMQ_HOST:DYN_KVBM_LEADER_ZMQ_PUB_PORT   (56001)
//	leader PULL bind tcp://DYN_KVBM_LEADER_ZMQ_HOST:DYN_KVBM_LEADER_ZMQ_ACK_PORT   (56002)
//	worker SUB  connect (all topics), worker PUSH connect
//
// PUB rather than ROUTER: every leader message is for every rank (a worker
// answers with its rank in the frame), so addressed sends buy nothing, and
// keeping the reference's socket pair keeps its two port variables meaning
// what they mean there. PUB drops what a subscriber that has not finished
// joining would have received (the "slow joiner"), so every handshake message
// is re-sent until every rank has answered it; operations are only broadcast
// once every rank has answered the handshake, i.e. is subscribed.
//
// When the leader and its only worker share a process (vLLM and TensorRT-LLM
// with TP=1), TransportInProc runs the same protocol over Go channels: no
// ports are bound and none can conflict.
//
// # Frames
//
// Coordinator → workers, multipart: [id u64 big-endian, function, payload?].
// Member → leader, multipart:  [id u64 big-endian, function, rank u32 big-endian, payload?].
// Ids are the leader's counter, starting at 1; a worker's unsolicited first
// message uses id 0.
//
//	function         direction  payload
//	worker_metadata  L→W        none: "report your metadata"
//	worker_metadata  W→L        msgpack WorkerMetadata (also sent unsolicited on connect)
//	leader_metadata  L→W        msgpack LeaderMetadata: allocate your tiers
//	allocating       W→L        none: leader_metadata received, allocation in progress
//	ping             L→W        none
//	step             L→W        an encoded plan.Step to execute
//	ack              W→L        none on success, else the error text; answers
//	                            leader_metadata (allocation finished), ping and step
//	shutdown         L→W        none: the leader is closing
//
// # Handshake
//
//  1. The leader broadcasts worker_metadata every RetryInterval until all
//     NumWorkers ranks reported (workers also report on their own as soon as
//     they connect, so workers may start before or after the leader, in any
//     order). It checks the reports agree: world size, bytes_per_block,
//     num_device_blocks, and no rank reported by two processes.
//  2. It sizes G2/G3 from bytes_per_block × NumWorkers (design §2) and
//     broadcasts leader_metadata until every rank acked it. A worker acks
//     only after its allocation finished (single flight: repeats of the
//     message while allocating are answered with "allocating").
//  3. Readiness is confirmed when every rank acked; an allocation error
//     fails the handshake and names the rank. The whole handshake is bounded
//     by DYN_KVBM_LEADER_WORKER_INIT_TIMEOUT_SECS; the timeout error names the
//     ranks that never answered and those still allocating.
//
// # Liveness
//
// After the handshake the leader pings every PingInterval (500 ms by default)
// and every message from a rank counts as a sign of life. Two states follow
// from what the leader can know:
//
//   - Suspected: silent for SuspectAfter
//     (DYN_KVBM_LEADER_WORKER_LIVENESS_TIMEOUT_SECS, 10 s by default: longer
//     than GC or scheduler pauses on a busy host). Operations waiting on it
//     fail with a *SuspectRanksError and later Broadcasts fail at once, so
//     nothing is planned for it; the engine keeps serving. When it answers
//     again it is re-admitted. No resynchronisation is needed: a worker runs
//     operations in order, so one that was given up on runs, late, before
//     anything broadcast after its return, and the caller never committed it
//     (a failed background operation frees its destination blocks in the
//     leader's view; a late write into free blocks is harmless).
//   - Dead, for good: the worker said goodbye (Close), another process
//     claimed its rank, or its process exited (checked through /proc when
//     the worker shares the leader's PID namespace, which it reports).
//     Operations waiting on it fail with a *DeadRanksError; later
//     Broadcasts fail at once.
//
// Each transition is logged once. Workers answer pings from their receive
// loop, so a long transfer does not look like silence.
//
// A worker notices its leader going away (the shutdown message from Close,
// or a lost connection whose port no longer accepts): Member.Done is closed
// and Member.Err says why. A lost connection to a leader that still listens
// (its PUB dropped a subscriber that stalled past the write timeout, a
// network fault), or a leader silent for MemberOptions.LeaderSilence (3 s by
// default, several pings), makes the worker redial its subscription: zmq4's
// SUB does not redial on its own. The leader re-admits the rank on its next
// answer.
package wire
