package main

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestEveryExportIsGuarded checks the house rule of abi.go on the source:
// the first statement of every //export function defers guard (exports
// with a status) or guardVoid (exports without one), so no panic unwinds
// into the engine and every panic poisons the library.
func TestEveryExportIsGuarded(t *testing.T) {
	files, err := filepath.Glob("*.go")
	require.NoError(t, err)
	fset := token.NewFileSet()
	exports := 0
	for _, name := range files {
		if strings.HasSuffix(name, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, name, nil, parser.ParseComments)
		require.NoError(t, err)
		for _, d := range f.Decls {
			fn, ok := d.(*ast.FuncDecl)
			if !ok || fn.Doc == nil || !isExport(fn.Doc) {
				continue
			}
			exports++
			require.True(t, strings.HasPrefix(fn.Name.Name, "kvbm_"), "%s: export outside the kvbm_ namespace", fn.Name.Name)
			require.NotEmpty(t, fn.Body.List, "%s: empty body", fn.Name.Name)
			def, ok := fn.Body.List[0].(*ast.DeferStmt)
			require.True(t, ok, "%s (%s): first statement is not a deferred guard", fn.Name.Name, name)
			callee, _ := def.Call.Fun.(*ast.Ident)
			require.NotNil(t, callee, "%s: deferred call is not guard/guardVoid", fn.Name.Name)
			hasStatus := fn.Type.Results != nil && len(fn.Type.Results.List) == 1 &&
				len(fn.Type.Results.List[0].Names) == 1 && fn.Type.Results.List[0].Names[0].Name == "rc"
			if hasStatus {
				require.Equal(t, "guard", callee.Name, "%s returns a status: defer guard(&rc, errOut)", fn.Name.Name)
			} else {
				require.Equal(t, "guardVoid", callee.Name, "%s returns no status: defer guardVoid()", fn.Name.Name)
			}
		}
	}
	require.Greater(t, exports, 30, "the exports were found")
}

func isExport(doc *ast.CommentGroup) bool {
	for _, c := range doc.List {
		if strings.HasPrefix(c.Text, "//export ") {
			return true
		}
	}
	return false
}

// TestHeaderDeclaresEveryExport: kvbm.h is the one definition of the ABI.
// The C compiler already rejects a prototype that disagrees with its export
// (every preamble includes the header); this catches the other two drifts,
// an export without a prototype and a prototype without an export.
func TestHeaderDeclaresEveryExport(t *testing.T) {
	header, err := os.ReadFile("kvbm.h")
	require.NoError(t, err)
	proto := regexp.MustCompile(`(?m)^[a-z0-9_]+[ *]+(kvbm_[a-z0-9_]+)\(`)
	var declared []string
	for _, m := range proto.FindAllStringSubmatch(string(header), -1) {
		declared = append(declared, m[1])
	}
	var exported []string
	files, err := filepath.Glob("*.go")
	require.NoError(t, err)
	for _, name := range files {
		if strings.HasSuffix(name, "_test.go") {
			continue
		}
		src, err := os.ReadFile(name)
		require.NoError(t, err)
		for _, m := range regexp.MustCompile(`(?m)^//export (kvbm_[a-z0-9_]+)$`).FindAllStringSubmatch(string(src), -1) {
			exported = append(exported, m[1])
		}
	}
	// The one export written in C (pylist.c) has no //export line.
	exported = append(exported, "kvbm_tokens_from_pylist")
	slices.Sort(declared)
	slices.Sort(exported)
	require.Greater(t, len(exported), 30)
	require.Equal(t, exported, declared, "kvbm.h prototypes vs exports")
}
