package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"reflect"
	"regexp"
	"slices"
	"sort"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// The info/stats exports answer JSON that Python reads back by key, typed by
// TypedDicts (and dataclasses built with **json) in python/kvbm. These tests
// parse those Python declarations and check every Go answer against them:
// the same keys, the optional ones exactly those Go may leave out, and JSON
// values of the declared Python type, so neither side can drift alone.

// pyClass is one class of annotated fields parsed from a Python file.
type pyClass struct {
	bases  []string
	total  bool      // TypedDict total= (false: every own field optional)
	fields []pyField // own fields, in order
}

type pyField struct {
	name, typ string
	required  bool
}

var (
	pyClassRe = regexp.MustCompile(`^class (\w+)(?:\((.*)\))?:\s*$`)
	pyFieldRe = regexp.MustCompile(`^    ([A-Za-z_]\w*): ([^=#]+?)\s*(?:#.*)?$`)
)

// parsePyClasses returns the classes of a Python source with their annotated
// class-level fields (docstrings and methods skipped).
func parsePyClasses(src string) map[string]*pyClass {
	out := map[string]*pyClass{}
	var cur *pyClass
	inDoc := false
	sc := bufio.NewScanner(strings.NewReader(src))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		wasDoc := inDoc
		if strings.Count(line, `"""`)%2 == 1 {
			inDoc = !inDoc
		}
		if wasDoc || strings.Contains(line, `"""`) {
			continue
		}
		if m := pyClassRe.FindStringSubmatch(line); m != nil {
			cur = &pyClass{total: true}
			for _, b := range strings.Split(m[2], ",") {
				b = strings.TrimSpace(b)
				switch {
				case b == "":
				case strings.ReplaceAll(b, " ", "") == "total=False":
					cur.total = false
				default:
					cur.bases = append(cur.bases, b)
				}
			}
			out[m[1]] = cur
			continue
		}
		if strings.TrimSpace(line) != "" && !strings.HasPrefix(line, " ") {
			cur = nil
			continue
		}
		if cur == nil {
			continue
		}
		if m := pyFieldRe.FindStringSubmatch(line); m != nil {
			cur.fields = append(cur.fields, pyField{name: m[1], typ: strings.TrimSpace(m[2]), required: cur.total})
		}
	}
	return out
}

// allFields is a class's fields with those of its base classes in classes.
func allFields(classes map[string]*pyClass, name string) []pyField {
	c := classes[name]
	if c == nil {
		return nil
	}
	var fs []pyField
	for _, b := range c.bases {
		fs = append(fs, allFields(classes, b)...)
	}
	return append(fs, c.fields...)
}

// checkShape checks goValue's JSON against the Python class name: filled
// (every field set, so every key appears) it has exactly the class's keys
// with values of their declared types; at its zero value (omitempty fields
// left out) it has exactly the required keys.
func checkShape(classes map[string]*pyClass, name string, goValue any) error {
	full := reflect.New(reflect.TypeOf(goValue)).Elem()
	fill(full)
	b, err := json.Marshal(full.Interface())
	if err != nil {
		return err
	}
	var v any
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber()
	if err := dec.Decode(&v); err != nil {
		return err
	}
	if err := checkValue(classes, name, name, v); err != nil {
		return err
	}
	zero, err := json.Marshal(reflect.Zero(reflect.TypeOf(goValue)).Interface())
	if err != nil {
		return err
	}
	var zm map[string]json.RawMessage
	if err := json.Unmarshal(zero, &zm); err != nil {
		return err
	}
	var required []string
	for _, f := range allFields(classes, name) {
		if f.required {
			required = append(required, f.name)
		}
	}
	if got := sortedKeys(zm); !slices.Equal(got, sorted(required)) {
		return fmt.Errorf("%s: keys always present: Go %v, Python (required) %v", name, got, sorted(required))
	}
	return nil
}

// checkValue checks a decoded JSON value against a Python annotation.
func checkValue(classes map[string]*pyClass, where, typ string, v any) error {
	switch {
	case typ == "int":
		n, ok := v.(json.Number)
		if !ok || strings.ContainsAny(n.String(), ".eE") {
			return fmt.Errorf("%s: want int, JSON has %v", where, v)
		}
	case typ == "float":
		if _, ok := v.(json.Number); !ok {
			return fmt.Errorf("%s: want float, JSON has %v", where, v)
		}
	case typ == "str":
		if _, ok := v.(string); !ok {
			return fmt.Errorf("%s: want str, JSON has %v", where, v)
		}
	case typ == "bool":
		if _, ok := v.(bool); !ok {
			return fmt.Errorf("%s: want bool, JSON has %v", where, v)
		}
	case strings.HasPrefix(typ, "list[") && strings.HasSuffix(typ, "]"):
		l, ok := v.([]any)
		if !ok || len(l) == 0 {
			return fmt.Errorf("%s: want a non-empty %s, JSON has %v", where, typ, v)
		}
		for i, e := range l {
			if err := checkValue(classes, fmt.Sprintf("%s[%d]", where, i), typ[5:len(typ)-1], e); err != nil {
				return err
			}
		}
	case classes[typ] != nil:
		m, ok := v.(map[string]any)
		if !ok {
			return fmt.Errorf("%s: want an object (%s), JSON has %v", where, typ, v)
		}
		fields := allFields(classes, typ)
		var names []string
		for _, f := range fields {
			names = append(names, f.name)
		}
		if got := sortedKeys(m); !slices.Equal(got, sorted(names)) {
			return fmt.Errorf("%s: keys: Go %v, Python %s %v", where, got, typ, sorted(names))
		}
		for _, f := range fields {
			if err := checkValue(classes, where+"."+f.name, f.typ, m[f.name]); err != nil {
				return err
			}
		}
	default:
		return fmt.Errorf("%s: Python type %q is not one this check knows", where, typ)
	}
	return nil
}

// fill sets every field of v, recursively: numbers 1 (floats 0.5), strings
// "x", true, one-element slices, allocated pointers.
func fill(v reflect.Value) {
	switch v.Kind() {
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		v.SetInt(1)
	case reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		v.SetUint(1)
	case reflect.Float32, reflect.Float64:
		v.SetFloat(0.5)
	case reflect.String:
		v.SetString("x")
	case reflect.Bool:
		v.SetBool(true)
	case reflect.Slice:
		v.Set(reflect.MakeSlice(v.Type(), 1, 1))
		fill(v.Index(0))
	case reflect.Pointer:
		v.Set(reflect.New(v.Type().Elem()))
		fill(v.Elem())
	case reflect.Struct:
		for i := 0; i < v.NumField(); i++ {
			if v.Type().Field(i).IsExported() {
				fill(v.Field(i))
			}
		}
	}
}

func sortedKeys[V any](m map[string]V) []string {
	ks := make([]string, 0, len(m))
	for k := range m {
		ks = append(ks, k)
	}
	sort.Strings(ks)
	return ks
}

func sorted(s []string) []string {
	s = slices.Clone(s)
	sort.Strings(s)
	return s
}

func pythonClasses(t *testing.T, files ...string) map[string]*pyClass {
	t.Helper()
	all := map[string]*pyClass{}
	for _, f := range files {
		src, err := os.ReadFile(f)
		require.NoError(t, err)
		for k, v := range parsePyClasses(string(src)) {
			all[k] = v
		}
	}
	return all
}

// TestInfoJSONMatchesPython checks every info/stats answer against the
// Python declaration that reads it.
func TestInfoJSONMatchesPython(t *testing.T) {
	classes := pythonClasses(t, "../python/kvbm/_core.py")
	for _, tc := range []struct {
		class string
		value any
	}{
		{"LeaderInfo", leaderInfo{}},
		{"WorkerInfo", workerInfo{}},
		{"ConsolidatorStats", consolidatorStats{}},
		{"LeaderSideChannelInfo", leaderSideChannelInfo{}},
		{"WorkerSideChannelInfo", workerSideChannelInfo{}},
	} {
		t.Run(tc.class, func(t *testing.T) {
			require.NotEmpty(t, allFields(classes, tc.class), "python/kvbm declares %s with fields", tc.class)
			require.NoError(t, checkShape(classes, tc.class, tc.value))
		})
	}
}

// TestInfoJSONCheckCatchesDrift: the check above fails on a missing, an
// extra, a mistyped and a wrongly optional key.
func TestInfoJSONCheckCatchesDrift(t *testing.T) {
	classes := parsePyClasses(`
class Inner(TypedDict):
    """Docstring: not_a_field: int"""

    n: int


class _Req(TypedDict):
    a: int  # a comment
    b: list[int]


class Outer(_Req, total=False):
    """Several lines:
    not_a_field: str
    """

    c: Inner
`)
	require.Equal(t, []pyField{{"a", "int", true}, {"b", "list[int]", true}, {"c", "Inner", false}}, allFields(classes, "Outer"))

	type inner struct {
		N int `json:"n"`
	}
	type good struct {
		A int    `json:"a"`
		B []int  `json:"b"`
		C *inner `json:"c,omitempty"`
	}
	require.NoError(t, checkShape(classes, "Outer", good{}))

	type missing struct {
		A int   `json:"a"`
		B []int `json:"b"`
	}
	type extra struct {
		good
		D int `json:"d"`
	}
	type mistyped struct {
		A float64 `json:"a"`
		B []int   `json:"b"`
		C *inner  `json:"c,omitempty"`
	}
	type notOptional struct {
		A int    `json:"a"`
		B []int  `json:"b"`
		C *inner `json:"c"`
	}
	type innerDrift struct {
		A int   `json:"a"`
		B []int `json:"b"`
		C *struct {
			M int `json:"m"`
		} `json:"c,omitempty"`
	}
	for name, v := range map[string]any{
		"missing": missing{}, "extra": extra{}, "mistyped": mistyped{}, "not optional": notOptional{}, "inner drift": innerDrift{},
	} {
		require.Error(t, checkShape(classes, "Outer", v), name)
	}
}
