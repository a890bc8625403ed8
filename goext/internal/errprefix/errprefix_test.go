package errprefix

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

// notYetChecked lists the goext packages (directories relative to goext/)
// this test skips for now, with everything below them.
var notYetChecked = []string{}

// marker, in a comment on the line of an error's creation or the line
// above, or in the doc comment of the function or declaration holding it,
// exempts that error because its message gets the prefix elsewhere: it is
// only ever wrapped by an error of the same package that carries it, or it
// leads with a wrapped error of the same package. A prefix of its own would
// repeat the package's name. The rest of the comment says where the prefix
// comes from.
const marker = "errprefix:"

// The rule, for every fmt.Errorf and errors.New outside _test.go files:
//   - the message starts with "<package name>: ", or
//   - it starts with "%w" and the first argument is a package-level
//     variable of the same package (a sentinel, itself checked here), or
//   - it carries the marker.
func TestErrorsCarryTheirPackagePrefix(t *testing.T) {
	root := filepath.Join("..", "..")
	dirs := map[string][]string{} // directory → its non-test Go files
	err := filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		if d.IsDir() {
			for _, skip := range notYetChecked {
				if rel == skip {
					return filepath.SkipDir
				}
			}
			if d.Name() == "testdata" {
				return filepath.SkipDir
			}
			return nil
		}
		if strings.HasSuffix(p, ".go") && !strings.HasSuffix(p, "_test.go") {
			dirs[filepath.Dir(p)] = append(dirs[filepath.Dir(p)], p)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	checked := 0
	for dir, files := range dirs {
		checked += checkPackage(t, dir, files)
	}
	// Guards against a walk that silently finds nothing (a moved directory).
	if len(dirs) < 10 || checked < 100 {
		t.Fatalf("checked %d errors in %d packages; the walk is broken", checked, len(dirs))
	}
}

// checkPackage reports every error of one package that breaks the rule and
// returns how many errors it looked at.
func checkPackage(t *testing.T, dir string, files []string) int {
	t.Helper()
	fset := token.NewFileSet()
	var parsed []*ast.File
	globals := map[string]bool{} // package-level variables
	for _, p := range files {
		f, err := parser.ParseFile(fset, p, nil, parser.ParseComments)
		if err != nil {
			t.Fatal(err)
		}
		parsed = append(parsed, f)
		for _, d := range f.Decls {
			if g, ok := d.(*ast.GenDecl); ok && g.Tok == token.VAR {
				for _, s := range g.Specs {
					for _, n := range s.(*ast.ValueSpec).Names {
						globals[n.Name] = true
					}
				}
			}
		}
	}
	n := 0
	for _, f := range parsed {
		prefix := f.Name.Name + ": "
		marked := map[int]bool{} // lines a marker comment covers
		for _, cg := range f.Comments {
			for _, c := range cg.List {
				if strings.Contains(c.Text, marker) {
					l := fset.Position(c.Pos()).Line
					marked[l], marked[l+1] = true, true
				}
			}
		}
		for _, d := range f.Decls {
			var doc *ast.CommentGroup
			switch d := d.(type) {
			case *ast.FuncDecl:
				doc = d.Doc
			case *ast.GenDecl:
				doc = d.Doc
			}
			if doc != nil && strings.Contains(doc.Text(), marker) {
				for l := fset.Position(d.Pos()).Line; l <= fset.Position(d.End()).Line; l++ {
					marked[l] = true
				}
			}
		}
		ast.Inspect(f, func(node ast.Node) bool {
			call, ok := node.(*ast.CallExpr)
			if !ok || !createsError(call) || len(call.Args) == 0 {
				return true
			}
			n++
			pos := fset.Position(call.Pos())
			if marked[pos.Line] {
				return true
			}
			msg, ok := constString(call.Args[0])
			switch {
			case !ok:
				t.Errorf("%s: error message is not a constant string; cannot check its %q prefix", pos, prefix)
			case strings.HasPrefix(msg, prefix):
			case strings.HasPrefix(msg, "%w") && len(call.Args) > 1 && isGlobal(call.Args[1], globals):
			default:
				t.Errorf("%s: error %q does not start with %q", pos, msg, prefix)
			}
			return true
		})
	}
	return n
}

// createsError reports whether call is fmt.Errorf or errors.New.
func createsError(call *ast.CallExpr) bool {
	sel, ok := call.Fun.(*ast.SelectorExpr)
	if !ok {
		return false
	}
	pkg, ok := sel.X.(*ast.Ident)
	if !ok {
		return false
	}
	return pkg.Name == "fmt" && sel.Sel.Name == "Errorf" || pkg.Name == "errors" && sel.Sel.Name == "New"
}

// constString evaluates a string literal or a + of string literals.
func constString(e ast.Expr) (string, bool) {
	switch e := e.(type) {
	case *ast.BasicLit:
		if e.Kind != token.STRING {
			return "", false
		}
		s, err := strconv.Unquote(e.Value)
		return s, err == nil
	case *ast.BinaryExpr:
		if e.Op != token.ADD {
			return "", false
		}
		l, ok := constString(e.X)
		if !ok {
			return "", false
		}
		r, ok := constString(e.Y)
		return l + r, ok
	case *ast.ParenExpr:
		return constString(e.X)
	}
	return "", false
}

func isGlobal(e ast.Expr, globals map[string]bool) bool {
	id, ok := e.(*ast.Ident)
	return ok && globals[id.Name]
}
