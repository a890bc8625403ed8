package main

import (
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"maps"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// abiExports is every export of kvbm.h that this build has, by name. A new
// export fails TestExportsRejectBadArguments until it is listed here and in
// abiValid, and then every buffer and output pointer its prototype declares
// is checked.
var abiExports = map[string]any{
	"kvbm_version":      kvbm_version,
	"kvbm_free_string":  kvbm_free_string,
	"kvbm_free_buffer":  kvbm_free_buffer,
	"kvbm_is_poisoned":  kvbm_is_poisoned,
	"kvbm_config_check": kvbm_config_check,
	"kvbm_build_info":   kvbm_build_info,

	"kvbm_salt_hash":       kvbm_salt_hash,
	"kvbm_sequence_hashes": kvbm_sequence_hashes,
	"kvbm_router_hashes":   kvbm_router_hashes,

	"kvbm_leader_new":                kvbm_leader_new,
	"kvbm_leader_wait_ready":         kvbm_leader_wait_ready,
	"kvbm_leader_free":               kvbm_leader_free,
	"kvbm_leader_info":               kvbm_leader_info,
	"kvbm_leader_match":              kvbm_leader_match,
	"kvbm_leader_update_after_alloc": kvbm_leader_update_after_alloc,
	"kvbm_leader_load_sources":       kvbm_leader_load_sources,
	"kvbm_leader_step":               kvbm_leader_step,
	"kvbm_leader_request_finished":   kvbm_leader_request_finished,
	"kvbm_leader_reset":              kvbm_leader_reset,
	"kvbm_leader_restore_disk":       kvbm_leader_restore_disk,
	"kvbm_leader_set_g4_fingerprint": kvbm_leader_set_g4_fingerprint,
	"kvbm_leader_g4_report":          kvbm_leader_g4_report,
	"kvbm_leader_transfer_timings":   kvbm_leader_transfer_timings,
	"kvbm_leader_take_events":        kvbm_leader_take_events,
	"kvbm_leader_figures_addr":       kvbm_leader_figures_addr,

	"kvbm_worker_new":              kvbm_worker_new,
	"kvbm_worker_free":             kvbm_worker_free,
	"kvbm_worker_info":             kvbm_worker_info,
	"kvbm_worker_bind":             kvbm_worker_bind,
	"kvbm_worker_start_load":       kvbm_worker_start_load,
	"kvbm_worker_wait_loads":       kvbm_worker_wait_loads,
	"kvbm_worker_wait_for_save":    kvbm_worker_wait_for_save,
	"kvbm_worker_finished":         kvbm_worker_finished,
	"kvbm_worker_recovered":        kvbm_worker_recovered,
	"kvbm_worker_g4_report":        kvbm_worker_g4_report,
	"kvbm_worker_stats":            kvbm_worker_stats,
	"kvbm_worker_figures_addr":     kvbm_worker_figures_addr,
	"kvbm_worker_transfer_timings": kvbm_worker_transfer_timings,

	"kvbm_consolidator_new":   kvbm_consolidator_new,
	"kvbm_consolidator_stats": kvbm_consolidator_stats,
	"kvbm_consolidator_free":  kvbm_consolidator_free,

	"kvbm_pagestore_new":    kvbm_pagestore_new,
	"kvbm_pagestore_free":   kvbm_pagestore_free,
	"kvbm_pagestore_info":   kvbm_pagestore_info,
	"kvbm_pagestore_put":    kvbm_pagestore_put,
	"kvbm_pagestore_get":    kvbm_pagestore_get,
	"kvbm_pagestore_exists": kvbm_pagestore_exists,
	"kvbm_pagestore_has":    kvbm_pagestore_has,
	"kvbm_pagestore_clear":  kvbm_pagestore_clear,
}

// abiTagged: exports of kvbm.h that only builds with a tag have; they take
// no buffer and no output (the test checks that on the header).
var abiTagged = map[string]string{
	"kvbm_worker_set_cuda_stream": "cuda",
	"kvbm_debug_panic":            "kvbm_debug",
	"kvbm_debug_panic_in_free":    "kvbm_debug",
}

// abiValid is a valid call of every export with a status, by the header's
// parameter names (what is left out takes invoke's defaults): each bad
// argument is checked against it, one at a time.
var abiValid = map[string]cCall{
	"kvbm_config_check":    {"env_json": testEnv},
	"kvbm_build_info":      {},
	"kvbm_salt_hash":       {"salt": "s", "has_salt": 1, "lora": "", "has_lora": 0},
	"kvbm_sequence_hashes": {"tokens": make([]uint32, 16), "block_size": 4, "out": make([]uint64, 8)},
	"kvbm_router_hashes":   {"tokens": make([]uint32, 16), "block_size": 4, "lora": "l", "out": make([]uint64, 8)},

	"kvbm_leader_new":                {"opts_json": leaderOpts},
	"kvbm_leader_wait_ready":         {"timeout_ms": 1},
	"kvbm_leader_info":               {},
	"kvbm_leader_match":              {"req_id": "r", "tokens": make([]uint32, 16)},
	"kvbm_leader_update_after_alloc": {"req_id": "r", "block_ids": []int64{0}},
	"kvbm_leader_load_sources":       {"req_id": "r"},
	"kvbm_leader_step":               {"in": []byte{0x93, 0x90, 0x90, 0x90}}, // msgpack [[], [], []]
	"kvbm_leader_request_finished":   {"req_id": "r"},
	"kvbm_leader_reset":              {},
	"kvbm_leader_restore_disk":       {"buf": []byte{0x90}}, // msgpack []
	"kvbm_leader_set_g4_fingerprint": {"fingerprint_hex": strings.Repeat("0", 31) + "1"},
	"kvbm_leader_g4_report":          {"buf": []byte{0x80}}, // msgpack {}
	"kvbm_leader_transfer_timings":   {"buf": []byte{0x80}}, // msgpack {}
	"kvbm_leader_take_events":        {},
	"kvbm_leader_figures_addr":       {},

	"kvbm_worker_new":              {}, // opts_json: workerOpts
	"kvbm_worker_info":             {},
	"kvbm_worker_bind":             {"buf": []byte{0x90}},
	"kvbm_worker_start_load":       {},
	"kvbm_worker_wait_loads":       {},
	"kvbm_worker_wait_for_save":    {},
	"kvbm_worker_finished":         {},
	"kvbm_worker_recovered":        {},
	"kvbm_worker_g4_report":        {},
	"kvbm_worker_stats":            {},
	"kvbm_worker_figures_addr":     {},
	"kvbm_worker_transfer_timings": {},

	"kvbm_consolidator_new":   {"opts_json": consolidatorOpts},
	"kvbm_consolidator_stats": {},

	"kvbm_pagestore_new":    {"opts_json": pagestoreOpts},
	"kvbm_pagestore_info":   {},
	"kvbm_pagestore_put":    pagestoreIO(&abiPutPage),
	"kvbm_pagestore_get":    pagestoreIO(&abiGetPage),
	"kvbm_pagestore_exists": {"keys": []byte("ab"), "key_ends": []int64{2}},
	"kvbm_pagestore_has":    {"keys": []byte("ab"), "key_ends": []int64{2}, "out_ok": make([]byte, 1)},
	"kvbm_pagestore_clear":  {},
}

// kvbm_tokens_from_pylist is written in C (pylist.c, called with the GIL
// held): it returns a count, not a status, and converts nothing for a NULL
// list or output or n ≤ 0.
const pylistExport = "kvbm_tokens_from_pylist"

// TestExportsRejectBadArguments: every export of kvbm.h that takes a
// (pointer, length) pair refuses a NULL pointer with a length, a negative
// length and an absurd one; every output pointer refuses NULL; every string
// may be NULL. Each is a KVBM_ERR_INVALID naming the export (and the
// length), never a crash or a poisoned library. The cases come from the
// prototypes, so a new export is checked as soon as it is listed.
func TestExportsRejectBadArguments(t *testing.T) {
	protos := parseHeader(t)
	handles := map[string]uint64{
		"leader":       newTestHandle(t, protos, "kvbm_leader_new", leaderOpts),
		"worker":       newTestHandle(t, protos, "kvbm_worker_new", workerOpts(t)),
		"consolidator": newTestHandle(t, protos, "kvbm_consolidator_new", consolidatorOpts),
		"pagestore":    newTestHandle(t, protos, "kvbm_pagestore_new", pagestoreOpts),
	}
	t.Cleanup(func() {
		for kind, h := range handles {
			freeTestHandle(kind, h)
		}
	})
	healthy := func(t *testing.T, what string) {
		t.Helper()
		if p := poison.Load(); p != nil {
			poison.Store(nil) // so that the other cases still run
			t.Errorf("%s poisoned the library: %s", what, strings.SplitN(*p, "\n", 2)[0])
		}
	}
	checked := 0
	for _, name := range slices.Sorted(maps.Keys(protos)) {
		proto := protos[name]
		if name == pylistExport {
			continue
		}
		fn, ok := abiExports[name]
		if !ok {
			tag, tagged := abiTagged[name]
			require.True(t, tagged, "%s is in kvbm.h but not in abiExports (and abiValid): list it", name)
			require.Empty(t, proto.buffers(), "%s (-tags %s) takes a buffer: test it in a file built with its tag", name, tag)
			require.Empty(t, proto.outputs(), "%s (-tags %s) has outputs: test it in a file built with its tag", name, tag)
			t.Logf("%s: in builds with -tags %s only; it takes no buffer and no output", name, tag)
			continue
		}
		if !proto.status() {
			require.Empty(t, proto.buffers(), "%s returns no status but takes a buffer", name)
			require.Empty(t, proto.outputs(), "%s returns no status but has outputs", name)
			continue
		}
		valid, ok := abiValid[name]
		require.True(t, ok, "%s: add a valid call to abiValid", name)
		t.Run(name, func(t *testing.T) {
			call := func(over cCall) callResult {
				args := maps.Clone(valid)
				maps.Copy(args, over)
				var created uint64
				for _, p := range proto.params {
					if _, set := args[p.name]; set {
						continue
					}
					switch {
					case p.name == "hd":
						kind := strings.SplitN(strings.TrimPrefix(name, "kvbm_"), "_", 2)[0]
						require.Contains(t, handles, kind, "%s: which handle?", name)
						args["hd"] = handles[kind]
					case p.name == "opts_json" && name == "kvbm_worker_new":
						args["opts_json"] = workerOpts(t)
					case p.name == "out" && strings.HasSuffix(name, "_new"):
						args["out"] = &created
					}
				}
				r := invoke(t, proto, fn, args)
				if created != 0 {
					freeTestHandle(strings.TrimSuffix(strings.TrimPrefix(name, "kvbm_"), "_new"), created)
				}
				return r
			}
			base := call(nil)
			healthy(t, "a valid call")
			require.NotEqual(t, statusInternal, base.rc, "valid call: %s", base)
			if base.rc != statusOK {
				t.Logf("the valid call answers %s (the checks below come first)", base)
			}
			for _, b := range proto.buffers() {
				ptr, n := proto.params[b[0]].name, proto.params[b[1]].name
				for _, bad := range []struct {
					over cCall
					n    int64
				}{
					{cCall{ptr: nullArg{}, n: lenArg(8)}, 8},
					{cCall{n: lenArg(-1)}, -1},
					{cCall{n: lenArg(1 << 62)}, 1 << 62},
				} {
					r := call(bad.over)
					what := fmt.Sprintf("%s=%v %s=%d", ptr, bad.over[ptr], n, bad.n)
					healthy(t, what)
					require.Equal(t, statusInvalid, r.rc, "%s accepted: %s", what, r)
					require.True(t, strings.HasPrefix(r.msg, name+": "), "%s: the error names the export: %s", what, r)
					require.Contains(t, r.msg, fmt.Sprintf("n=%d", bad.n), "%s: the error gives the length", what)
					checked++
				}
			}
			for _, o := range proto.outputs() {
				out := proto.params[o].name
				r := call(cCall{out: nullArg{}})
				healthy(t, "NULL "+out)
				require.Equal(t, statusInvalid, r.rc, "NULL %s accepted: %s", out, r)
				require.True(t, strings.HasPrefix(r.msg, name+": "), "NULL %s: the error names the export: %s", out, r)
				require.Contains(t, r.msg, "null output", "NULL %s", out)
				checked++
			}
			for _, s := range proto.strings() {
				str := proto.params[s].name
				r := call(cCall{str: nullArg{}})
				healthy(t, "NULL "+str)
				require.NotEqual(t, statusInternal, r.rc, "NULL %s: %s", str, r)
			}
		})
	}
	require.Greater(t, checked, 40, "bad arguments were tried")
}

// TestHandleExportsHoldTheirHandle checks on the source what
// TestFreeRacingCalls shows at run time, for every export: one that takes a
// handle (hd) holds it for the whole call (it defers the done of
// acquire/leaderOf/workerOf), and a _free export frees through freeHandle,
// which waits for those calls.
func TestHandleExportsHoldTheirHandle(t *testing.T) {
	files, err := filepath.Glob("*.go")
	require.NoError(t, err)
	fset := token.NewFileSet()
	n := 0
	for _, file := range files {
		if strings.HasSuffix(file, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, file, nil, parser.ParseComments)
		require.NoError(t, err)
		for _, d := range f.Decls {
			fn, ok := d.(*ast.FuncDecl)
			if !ok || fn.Doc == nil || !isExport(fn.Doc) || !takesHandle(fn) {
				continue
			}
			n++
			var defersDone, callsFree bool
			ast.Inspect(fn.Body, func(x ast.Node) bool {
				switch s := x.(type) {
				case *ast.DeferStmt:
					if id, ok := s.Call.Fun.(*ast.Ident); ok && id.Name == "done" {
						defersDone = true
					}
				case *ast.CallExpr:
					if id, ok := s.Fun.(*ast.Ident); ok && id.Name == "freeHandle" {
						callsFree = true
					}
				}
				return true
			})
			if strings.HasSuffix(fn.Name.Name, "_free") {
				require.True(t, callsFree, "%s (%s): free through freeHandle", fn.Name.Name, file)
			} else {
				require.True(t, defersDone, "%s (%s): hold the handle: h, done, err := acquire/leaderOf/workerOf(hd); defer done()", fn.Name.Name, file)
			}
		}
	}
	require.Greater(t, n, 20, "the handle exports were found")
}

func takesHandle(fn *ast.FuncDecl) bool {
	for _, f := range fn.Type.Params.List {
		for _, id := range f.Names {
			if id.Name == "hd" {
				return true
			}
		}
	}
	return false
}
