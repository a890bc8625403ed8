/*
 * kvbm.h: the C ABI of libkvbm.so, kvbm's multi-tier KV cache block manager.
 *
 * Every capi/*.go file includes this header in its cgo preamble, so the C
 * compiler rejects an export whose Go signature disagrees with a prototype
 * here; tests check that every export has a prototype and that the Python
 * bindings (python/kvbm/_native.py and the modules registering signatures)
 * declare the same argument and result types.
 *
 * Conventions:
 *   - A function returning int returns a kvbm_status; on error, *err receives
 *     a malloc'ed message the caller releases with kvbm_free_string.
 *   - Handles are opaque uint64 values released by the matching _free call.
 *   - Buffers returned through (uint8_t **out, int64_t *out_len) are released
 *     with kvbm_free_buffer.
 *   - Options and results are JSON or msgpack documents (see docs/design.md).
 */
#ifndef KVBM_H
#define KVBM_H

#include <stdint.h>
#include <stdlib.h>

enum kvbm_status {
	KVBM_OK = 0,
	KVBM_ERR_INVALID = 1,  /* bad argument or input */
	KVBM_ERR_CONFIG = 2,   /* invalid configuration (the message names the variable) */
	KVBM_ERR_IO = 3,       /* file system, network, memory mapping */
	KVBM_ERR_STATE = 4,    /* unknown handle, call in the wrong state */
	KVBM_ERR_INTERNAL = 5, /* a panic was recovered; the library is now poisoned */
	KVBM_ERR_POISONED = 6  /* an earlier panic poisoned the library */
};

/* library */
char *kvbm_version(void);
void kvbm_free_string(char *s);
void kvbm_free_buffer(uint8_t *p);
int kvbm_is_poisoned(void);
int kvbm_config_check(char *env_json, int require_tier, uint8_t **out, int64_t *out_len, char **err);
/* JSON: {"variant": "host" | "cuda", "version", "go"}; the variant says whether G1 may be GPU memory */
int kvbm_build_info(uint8_t **out, int64_t *out_len, char **err);

/* hashing */
int kvbm_salt_hash(char *salt, int has_salt, char *lora, int has_lora, uint64_t *out, char **err);
int kvbm_sequence_hashes(uint32_t *tokens, int64_t n, int64_t block_size, uint64_t salt, uint64_t *out,
                         int64_t out_cap, int64_t *out_n, char **err);
int kvbm_router_hashes(uint32_t *tokens, int64_t n, int64_t block_size, char *lora, uint64_t *out, int64_t out_cap,
                       int64_t *out_n, char **err);

/* Reads up to n token ids of a CPython list in place (see capi/pylist.c);
 * returns how many it converted. Called only through ctypes with the GIL held. */
int64_t kvbm_tokens_from_pylist(const void *list, int64_t n, const void *int_type, int32_t layout, uint32_t *out);

/* leader (the engine's scheduler process). With tensor-parallel ranks in other processes the options carry a
 * "side_channel" object: kvbm_leader_new binds it and kvbm_leader_wait_ready (in slices of timeout_ms) completes
 * the handshake and creates the leader, which then drives its background operations over it. */
int kvbm_leader_new(char *opts_json, uint64_t *out, char **err);
int kvbm_leader_wait_ready(uint64_t hd, int64_t timeout_ms, int32_t *out_ready, char **err);
void kvbm_leader_free(uint64_t hd);
int kvbm_leader_info(uint64_t hd, uint8_t **out, int64_t *out_len, char **err);
int kvbm_leader_figures_addr(uint64_t hd, uint64_t *out, int64_t *out_n, char **err); /* figures read without a call: figures.go */
int kvbm_leader_match(uint64_t hd, char *req_id, uint32_t *tokens, int64_t n, uint64_t salt, int64_t num_computed,
                      int64_t *out_tokens, int32_t *out_async, char **err);
int kvbm_leader_update_after_alloc(uint64_t hd, char *req_id, int64_t *block_ids, int64_t n, int64_t num_external,
                                   char **err);
int kvbm_leader_load_sources(uint64_t hd, char *req_id, int64_t num_tokens, int64_t *out_host, int64_t *out_disk,
                             int64_t *out_remote, char **err);
int kvbm_leader_step(uint64_t hd, void *in, int64_t in_len, uint8_t **out, int64_t *out_len, char **err);
int kvbm_leader_request_finished(uint64_t hd, char *req_id, int32_t *out_pending, char **err);
int kvbm_leader_reset(uint64_t hd, char **err);
/* persistent disk tier: register what every rank recovered (msgpack array of kvbm_worker_recovered results) */
int kvbm_leader_restore_disk(uint64_t hd, void *buf, int64_t n, int64_t *out_registered, char **err);
/* G4 (object storage, docs/g4.md): rank 0's block fingerprint (32 hex digits); a worker's msgpack report */
int kvbm_leader_set_g4_fingerprint(uint64_t hd, char *fingerprint_hex, char **err);
int kvbm_leader_g4_report(uint64_t hd, void *buf, int64_t n, char **err);
/* load-cost model: a worker's timed load batches (msgpack, kvbm_worker_transfer_timings) */
int kvbm_leader_transfer_timings(uint64_t hd, void *buf, int64_t n, char **err);
/* G2/G3 store and removal events since the last call (msgpack; a leader created with "tier_events") */
int kvbm_leader_take_events(uint64_t hd, uint8_t **out, int64_t *out_len, char **err);

/* worker (one per tensor-parallel rank; its options' "side_channel" connects it to the leader's) */
int kvbm_worker_new(char *opts_json, uint64_t *out, char **err);
void kvbm_worker_free(uint64_t hd);
int kvbm_worker_info(uint64_t hd, uint8_t **out, int64_t *out_len, char **err);
int kvbm_worker_bind(uint64_t hd, void *buf, int64_t n, uint8_t **out, int64_t *out_len, char **err); /* msgpack [loads, start, save] */
int kvbm_worker_start_load(uint64_t hd, char **err);
int kvbm_worker_wait_loads(uint64_t hd, char **err);
int kvbm_worker_wait_for_save(uint64_t hd, char **err);
int kvbm_worker_finished(uint64_t hd, uint8_t **out, int64_t *out_len, char **err);
int kvbm_worker_set_cuda_stream(uint64_t hd, uint64_t stream, char **err); /* CUDA build only */
int kvbm_worker_recovered(uint64_t hd, uint8_t **out, int64_t *out_len, char **err); /* persistent disk tier index */
int kvbm_worker_g4_report(uint64_t hd, uint8_t **out, int64_t *out_len, char **err); /* G4: stored hashes, counters */
int kvbm_worker_stats(uint64_t hd, uint8_t **out, int64_t *out_len, char **err); /* JSON: transfer totals per direction */
int kvbm_worker_figures_addr(uint64_t hd, uint64_t *out, int64_t *out_n, char **err); /* figures read without a call: figures.go */
int kvbm_worker_transfer_timings(uint64_t hd, uint8_t **out, int64_t *out_len, char **err); /* rank 0's timed load batches since the last call */

/* KV event consolidator */
int kvbm_consolidator_new(char *opts_json, uint64_t *out, char **err);
int kvbm_consolidator_stats(uint64_t hd, uint8_t **out, int64_t *out_len, char **err);
void kvbm_consolidator_free(uint64_t hd);

/* page store over the disk tier, keyed by an engine's key strings (SGLang HiCache's L3 backend): keys is the
 * concatenated key bytes, key_ends each key's end offset in it; segs (address, length) pairs of host memory, page i
 * being pairs [page_ends[i-1], page_ends[i]) whose lengths add up to the store's page size; out_ok[i] = 1 where key i
 * was stored / read (a page failing its checksum or MAC reads as missing) */
int kvbm_pagestore_new(char *opts_json, uint64_t *out, char **err);
void kvbm_pagestore_free(uint64_t hd);
int kvbm_pagestore_info(uint64_t hd, uint8_t **out, int64_t *out_len, char **err);
int kvbm_pagestore_put(uint64_t hd, void *keys, int64_t keys_len, int64_t *key_ends, int64_t n, uint64_t *segs,
                       int64_t segs_len, int64_t *page_ends, int64_t pages_len, uint8_t *out_ok, int64_t out_cap,
                       char **err);
int kvbm_pagestore_get(uint64_t hd, void *keys, int64_t keys_len, int64_t *key_ends, int64_t n, uint64_t *segs,
                       int64_t segs_len, int64_t *page_ends, int64_t pages_len, uint8_t *out_ok, int64_t out_cap,
                       char **err);
int kvbm_pagestore_exists(uint64_t hd, void *keys, int64_t keys_len, int64_t *key_ends, int64_t n, int64_t *out_hits,
                          char **err);
/* out_ok[i] = 1 where the store holds key i (disk tier, else object tier) */
int kvbm_pagestore_has(uint64_t hd, void *keys, int64_t keys_len, int64_t *key_ends, int64_t n, uint8_t *out_ok,
                       int64_t out_cap, char **err);
int kvbm_pagestore_clear(uint64_t hd, char **err);

/* test-only exports, present in libkvbm_debug.so (built with -tags kvbm_debug) */
int kvbm_debug_panic(char **err);
void kvbm_debug_panic_in_free(void);

#endif /* KVBM_H */
