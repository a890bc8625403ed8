package docvars

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// tables are the files whose "| variable | default | meaning |" tables
// document kvbm's variables: the README, and the G4 page it links for the
// object tier's.
var tables = []string{"README.md", filepath.Join("docs", "g4.md")}

// notConfig are the variables documented in those tables that goext/config
// does not read, with who reads them: the engine adapters must know them
// before the library loads, or they configure Python only (python/kvbm).
var notConfig = map[string]string{
	"DYN_KVBM_KV_EVENTS_BIND_HOST": "python/kvbm/_envs.py: where the adapter binds the consolidated stream",
	"DYN_KVBM_ENABLE_RECORD":       "python/kvbm/_record.py: records the adapter's calls",
	"DYN_KVBM_RECORD_PATH":         "python/kvbm/_record.py",
	"KVBM_LIBRARY":                 "python/kvbm/_native.py: which library to load",
	"KVBM_DISABLE_CUDA":            "python/kvbm/_native.py: which library to load",
	"KVBM_CUDA_PACK_KV_CACHE":      "python/kvbm/_kvpool.py: the vLLM connector's KV cache pool",
	"DYN_NAMESPACE":                "the engine adapters' RouterEvent namespace",
	"DYN_KVBM_WORKER_ID":           "the engine adapters' RouterEvent worker id",
	"DYN_KVBM_THREAD_AFFINITY":     "python/kvbm/_affinity.py: where the Go runtime starts its threads, before the library loads",
}

var (
	constRe = regexp.MustCompile(`(?m)^\s*(?:const\s+)?Env\w+\s*=\s*"([A-Z][A-Z0-9_]*)"`)
	nameRe  = regexp.MustCompile(`\b(?:DYN|KVBM|NATS|AWS)_[A-Z0-9_]*[A-Z0-9]\b|\bNATS_SERVER\b`)
	shortRe = regexp.MustCompile(`(?:^|[\s/])(_[A-Z0-9_]*[A-Z0-9])\b`)
)

// configVars are the variables goext/config declares (Env… constants).
func configVars(t *testing.T) map[string]bool {
	files, err := filepath.Glob(filepath.Join("..", "..", "config", "*.go"))
	require.NoError(t, err)
	vars := map[string]bool{}
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		b, err := os.ReadFile(f)
		require.NoError(t, err)
		for _, m := range constRe.FindAllStringSubmatch(string(b), -1) {
			if !strings.HasSuffix(m[1], "_") { // a prefix (DYN_KVBM_NIXL_BACKEND_<NAME>)
				vars[m[1]] = true
			}
		}
	}
	require.Greater(t, len(vars), 40, "the walk of goext/config is broken")
	return vars
}

// documented reads the tables: names written in full in a row's first two
// cells, and the candidates of each shorthand ("_PUB_PORT" after
// "DYN_KVBM_LEADER_ZMQ_HOST": the first name with its last segments
// replaced or kept, then the shorthand).
func documented(t *testing.T) (full, shorthand map[string]bool) {
	full, shorthand = map[string]bool{}, map[string]bool{}
	for _, f := range tables {
		b, err := os.ReadFile(filepath.Join("..", "..", "..", f))
		require.NoError(t, err)
		inTable := false
		for _, line := range strings.Split(string(b), "\n") {
			if strings.HasPrefix(line, "| variable |") {
				inTable = true
				continue
			}
			if !strings.HasPrefix(line, "|") {
				inTable = false
				continue
			}
			cells := strings.Split(line, "|")
			if !inTable || len(cells) < 4 || strings.HasPrefix(line, "|---") {
				continue
			}
			first := strings.ReplaceAll(cells[1], "`", "")
			names := nameRe.FindAllString(first, -1)
			for _, n := range append(names, nameRe.FindAllString(cells[2], -1)...) {
				full[n] = true
			}
			if len(names) == 0 {
				continue
			}
			segs := strings.Split(names[0], "_")
			for _, m := range shortRe.FindAllStringSubmatch(first, -1) {
				for keep := 1; keep <= len(segs); keep++ {
					shorthand[strings.Join(segs[:keep], "_")+m[1]] = true
				}
			}
		}
	}
	require.Greater(t, len(full), 40, "the walk of the tables is broken")
	return full, shorthand
}

// TestReadmeDocumentsEveryVariable: every variable goext/config reads has a
// row (in full or as a shorthand of the row's first name).
func TestReadmeDocumentsEveryVariable(t *testing.T) {
	full, short := documented(t)
	for v := range configVars(t) {
		if !full[v] && !short[v] {
			t.Errorf("%s is read by goext/config but has no row in the variable tables of %v", v, tables)
		}
	}
}

// TestReadmeVariablesAreRead: every variable written in full in a table's
// first cell is read by goext/config or listed in notConfig with its reader.
func TestReadmeVariablesAreRead(t *testing.T) {
	full, _ := documented(t)
	vars := configVars(t)
	for v := range full {
		if vars[v] || notConfig[v] != "" {
			continue
		}
		t.Errorf("%s is documented in %v but goext/config does not read it: add it to config.Config, "+
			"or to notConfig with what reads it", v, tables)
	}
}

// goextPackages lists the directories of goext holding Go files (internal/
// ones as "internal/<name>").
func goextPackages(t *testing.T) []string {
	root := filepath.Join("..", "..")
	var pkgs []string
	err := filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
		if err != nil || !d.IsDir() || p == root {
			return err
		}
		if d.Name() == "testdata" {
			return filepath.SkipDir
		}
		if gos, _ := filepath.Glob(filepath.Join(p, "*.go")); len(gos) > 0 {
			rel, _ := filepath.Rel(root, p)
			pkgs = append(pkgs, filepath.ToSlash(rel))
		}
		return nil
	})
	require.NoError(t, err)
	require.Greater(t, len(pkgs), 15, "the walk of goext is broken")
	return pkgs
}

// TestPackageListsAgree: the README's layout names every goext package,
// and docs/architecture.md's package table has a row for each.
func TestPackageListsAgree(t *testing.T) {
	readme, err := os.ReadFile(filepath.Join("..", "..", "..", "README.md"))
	require.NoError(t, err)
	block := string(readme)
	start := strings.Index(block, "goext/     the Go library")
	require.GreaterOrEqual(t, start, 0, "README's layout block")
	block = block[start:]
	block = block[:strings.Index(block, "\ninternal/")]
	listed := map[string]bool{}
	inner := block[strings.Index(block, "(")+1 : strings.LastIndex(block, ")")]
	main, internal, _ := strings.Cut(inner, "; goext/internal:")
	for _, n := range strings.FieldsFunc(main, func(r rune) bool { return r == ',' || r == ' ' || r == '\n' }) {
		listed[n] = true
	}
	for _, n := range strings.FieldsFunc(internal, func(r rune) bool { return r == ',' || r == ' ' || r == '\n' }) {
		listed["internal/"+n] = true
	}
	arch, err := os.ReadFile(filepath.Join("..", "..", "..", "docs", "architecture.md"))
	require.NoError(t, err)
	pkgs := goextPackages(t)
	for _, p := range pkgs {
		if !listed[p] {
			t.Errorf("README's layout does not list goext/%s", p)
		}
		if !strings.Contains(string(arch), "`"+p+"`") {
			t.Errorf("docs/architecture.md's package table has no row for `%s`", p)
		}
	}
	require.Len(t, listed, len(pkgs), "README lists a package goext does not have: %v", listed)
}
