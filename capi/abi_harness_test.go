package main

import (
	"fmt"
	"os"
	"reflect"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/require"
)

// A harness that calls the exports the way a C caller does, from Go tests
// (a _test.go file cannot use cgo): arguments are built by reflection from
// the exports' own parameter types, driven by the prototypes of kvbm.h.

// cParam is one parameter of a kvbm.h prototype.
type cParam struct {
	typ   string // "uint8_t **", "int64_t", "char *", ...
	name  string
	stars int
}

type cProto struct {
	ret, name string
	params    []cParam
}

var (
	protoRe   = regexp.MustCompile(`(?s)(?:^|\n)([a-z0-9_]+[ *]+)(kvbm_[a-z0-9_]+)\(([^)]*)\);`)
	commentRe = regexp.MustCompile(`(?s)/\*.*?\*/`)
)

// parseHeader returns kvbm.h's prototypes by name.
func parseHeader(t *testing.T) map[string]cProto {
	src, err := os.ReadFile("kvbm.h")
	require.NoError(t, err)
	text := commentRe.ReplaceAllString(string(src), "")
	out := map[string]cProto{}
	for _, m := range protoRe.FindAllStringSubmatch(text, -1) {
		p := cProto{ret: strings.TrimSpace(m[1]), name: m[2]}
		args := strings.Join(strings.Fields(m[3]), " ")
		if args != "void" && args != "" {
			for _, a := range strings.Split(args, ",") {
				a = strings.TrimSpace(a)
				i := strings.LastIndexAny(a, " *")
				require.Positive(t, i, "%s: parameter %q", p.name, a)
				typ := strings.TrimSpace(strings.TrimPrefix(a[:i+1], "const "))
				p.params = append(p.params, cParam{typ: typ, name: a[i+1:], stars: strings.Count(typ, "*")})
			}
		}
		out[p.name] = p
	}
	require.Greater(t, len(out), 30, "kvbm.h prototypes were found")
	return out
}

// The roles of parameters, read from the prototypes (kvbm.h's conventions).

// isErr: the char **err every status export ends with (NULL is allowed).
func (p cParam) isErr() bool { return p.name == "err" && p.typ == "char **" }

// isLen: an int64_t length that follows its buffer.
func (p cParam) isLen() bool {
	return p.typ == "int64_t" && (p.name == "n" || strings.HasSuffix(p.name, "_len") || strings.HasSuffix(p.name, "_cap"))
}

// isOut: an output pointer (out, out_len, out_tokens, ...).
func (p cParam) isOut() bool { return p.stars > 0 && strings.HasPrefix(p.name, "out") }

// buffers returns the indexes of (pointer, length) pairs: input buffers and
// output arrays with a capacity.
func (p cProto) buffers() [][2]int {
	var out [][2]int
	for i := 0; i+1 < len(p.params); i++ {
		if p.params[i].stars == 1 && p.params[i+1].isLen() {
			out = append(out, [2]int{i, i + 1})
		}
	}
	return out
}

// outputs returns the indexes of the output pointers but output arrays
// (those are buffers).
func (p cProto) outputs() []int {
	var out []int
	for i, q := range p.params {
		if q.isOut() && !(i+1 < len(p.params) && p.params[i+1].isLen()) {
			out = append(out, i)
		}
	}
	return out
}

func (p cProto) strings() []int {
	var out []int
	for i, q := range p.params {
		if q.typ == "char *" {
			out = append(out, i)
		}
	}
	return out
}

func (p cProto) status() bool {
	return p.ret == "int" && len(p.params) > 0 && p.params[len(p.params)-1].isErr()
}

// cCall is one call of an export: its arguments by header name; what is not
// named takes the harness default (handles by the export's prefix, fresh
// outputs, NULL error pointer filled, zero).
type cCall map[string]any

// nullArg in a cCall passes NULL.
type nullArg struct{}

// lenArg in a cCall passes the length as given, whatever the buffer.
type lenArg int64

// callResult is an export's outcome.
type callResult struct {
	rc  int
	msg string
}

func (r callResult) String() string { return fmt.Sprintf("rc=%d %q", r.rc, r.msg) }

// invoke calls export fn with args built for proto; handles are the
// handle to pass for a uint64_t hd by the export's kind.
func invoke(t testing.TB, proto cProto, fn any, args cCall) callResult {
	t.Helper()
	fv := reflect.ValueOf(fn)
	ft := fv.Type()
	require.Equal(t, len(proto.params), ft.NumIn(), "%s: header and Go disagree on the parameters", proto.name)
	var keep []any // Go memory the call points into
	in := make([]reflect.Value, ft.NumIn())
	var errPtr reflect.Value
	var bufOuts []reflect.Value // uint8_t ** outputs: freed after the call
	lengthOf := map[int]int64{}
	for i, p := range proto.params {
		pt := ft.In(i)
		v, named := args[p.name]
		switch {
		case p.isErr():
			errPtr = reflect.New(pt.Elem())
			in[i] = errPtr
			continue
		case v == (nullArg{}):
			in[i] = reflect.Zero(pt)
			continue
		case !named && p.isOut():
			out := reflect.New(pt.Elem())
			if p.stars == 2 {
				bufOuts = append(bufOuts, out)
			}
			in[i] = out
			continue
		}
		switch x := v.(type) {
		case nil:
			in[i] = reflect.Zero(pt)
		case string:
			b := append([]byte(x), 0)
			keep = append(keep, b)
			in[i] = reflect.NewAt(pt.Elem(), unsafe.Pointer(&b[0]))
		case []byte, []uint32, []int64, []uint64:
			sv := reflect.ValueOf(x)
			require.Positive(t, sv.Len(), "%s: %s: give a non-empty buffer", proto.name, p.name)
			keep = append(keep, x)
			ptr := unsafe.Pointer(sv.Index(0).Addr().Pointer())
			if pt.Kind() == reflect.UnsafePointer {
				in[i] = reflect.ValueOf(ptr)
			} else {
				in[i] = reflect.NewAt(pt.Elem(), ptr)
			}
			lengthOf[i+1] = int64(sv.Len())
		case lenArg:
			in[i] = reflect.ValueOf(int64(x)).Convert(pt)
		case int:
			in[i] = reflect.ValueOf(int64(x)).Convert(pt)
		case uint64:
			in[i] = reflect.ValueOf(x).Convert(pt)
		case *uint64, *int64, *int32:
			in[i] = reflect.NewAt(pt.Elem(), reflect.ValueOf(x).UnsafePointer())
		default:
			t.Fatalf("%s: %s: unsupported argument %T", proto.name, p.name, v)
		}
	}
	// Lengths not given follow their buffer.
	for i, p := range proto.params {
		if _, named := args[p.name]; !named && p.isLen() {
			in[i] = reflect.ValueOf(lengthOf[i]).Convert(ft.In(i))
		}
		if !in[i].IsValid() {
			in[i] = reflect.Zero(ft.In(i))
		}
	}
	res := fv.Call(in)
	keepAlive(keep)
	var r callResult
	if len(res) == 1 && res[0].CanInt() {
		r.rc = int(res[0].Int())
	}
	if errPtr.IsValid() && !errPtr.Elem().IsNil() {
		r.msg = goStringAt(errPtr.Elem().UnsafePointer())
		reflect.ValueOf(kvbm_free_string).Call([]reflect.Value{errPtr.Elem()})
	}
	for _, o := range bufOuts {
		if !o.Elem().IsNil() {
			reflect.ValueOf(kvbm_free_buffer).Call([]reflect.Value{o.Elem()})
		}
	}
	return r
}

//go:noinline
func keepAlive(v []any) {}

func goStringAt(p unsafe.Pointer) string {
	var b []byte
	for i := uintptr(0); ; i++ {
		c := *(*byte)(unsafe.Add(p, i))
		if c == 0 {
			return string(b)
		}
		b = append(b, c)
	}
}

// Handles for the tests: a leader, a worker over host memory standing in
// for an engine's KV cache, and a standalone consolidator.

const testEnv = `{"DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS":"4"}`

var (
	leaderOpts       = `{"block_size":4,"bytes_per_block":64,"env":` + testEnv + `}`
	consolidatorOpts = `{"zmq_bind":"tcp://127.0.0.1:0","env":{}}`
)

// workerOpts returns kvbm_worker_new's options over a KV cache of the
// flash_attn layout [2, 8 blocks, 4 tokens, 2 heads, 8] of uint16 in an
// anonymous mapping that lives until the test ends.
func workerOpts(t testing.TB) string {
	mem, err := syscall.Mmap(-1, 0, 4096, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_ANON|syscall.MAP_PRIVATE)
	require.NoError(t, err)
	t.Cleanup(func() { _ = syscall.Munmap(mem) })
	return fmt.Sprintf(`{"kind":"flash_attn","num_blocks":8,"block_size":4,"dtype_bytes":2,`+
		`"tensors":[{"ptr":%d,"shape":[2,8,4,2,8],"strides":[512,64,16,8,1]}],"env":%s}`,
		uintptr(unsafe.Pointer(&mem[0])), testEnv)
}

// newTestHandle creates a handle with constructor (kvbm_leader_new, ...).
func newTestHandle(t testing.TB, protos map[string]cProto, constructor string, opts string) uint64 {
	t.Helper()
	var h uint64
	r := invoke(t, protos[constructor], abiExports[constructor], cCall{"opts_json": opts, "out": &h})
	require.Equal(t, statusOK, r.rc, "%s: %s", constructor, r)
	require.NotZero(t, h)
	return h
}

// freeTestHandle frees h with kind's _free export.
func freeTestHandle(kind string, h uint64) {
	reflect.ValueOf(abiExports["kvbm_"+kind+"_free"]).Call([]reflect.Value{
		reflect.ValueOf(h).Convert(reflect.TypeOf(abiExports["kvbm_"+kind+"_free"]).In(0))})
}
