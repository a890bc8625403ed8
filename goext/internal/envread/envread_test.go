package envread

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// marker, in a comment on the line of the call or the line above, allows a
// read that is no kvbm setting: a test or bench harness's own variable (where
// its server binary is, where a bench writes its rows) or the environment
// passed on to a child process. The rest of the comment says which.
const marker = "envread:"

var reads = map[string]bool{"Getenv": true, "LookupEnv": true, "Environ": true}

// TestOnlyConfigReadsTheEnvironment walks every non-test Go file of the
// module (goext, capi, bench) and fails on each call of os.Getenv,
// os.LookupEnv or os.Environ outside goext/config that carries no marker.
func TestOnlyConfigReadsTheEnvironment(t *testing.T) {
	root := filepath.Join("..", "..", "..")
	files := 0
	var bad []string
	err := filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		if d.IsDir() {
			name := d.Name()
			if rel == filepath.Join("goext", "config") || name == "testdata" ||
				(rel != "." && (strings.HasPrefix(name, ".") || name == "python" || name == "tests")) {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(p, ".go") || strings.HasSuffix(p, "_test.go") {
			return nil
		}
		files++
		fset := token.NewFileSet()
		f, err := parser.ParseFile(fset, p, nil, parser.ParseComments)
		if err != nil {
			return err
		}
		marked := map[int]bool{}
		for _, cg := range f.Comments {
			for _, c := range cg.List {
				if strings.Contains(c.Text, marker) {
					l := fset.Position(c.Pos()).Line
					marked[l], marked[l+1] = true, true
				}
			}
		}
		ast.Inspect(f, func(n ast.Node) bool {
			sel, ok := n.(*ast.SelectorExpr)
			if !ok || !reads[sel.Sel.Name] {
				return true
			}
			if id, ok := sel.X.(*ast.Ident); !ok || id.Name != "os" {
				return true
			}
			pos := fset.Position(sel.Pos())
			if !marked[pos.Line] {
				bad = append(bad, rel+":"+strconv.Itoa(pos.Line)+": os."+sel.Sel.Name)
			}
			return true
		})
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	for _, b := range bad {
		t.Errorf("%s reads the environment outside goext/config: add the setting to config.Config "+
			"(read, validated and documented there) and pass it in", b)
	}
	// Guards against a walk that silently finds nothing (a moved directory).
	if files < 100 {
		t.Fatalf("walked %d Go files; the walk is broken", files)
	}
}
