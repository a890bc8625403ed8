// Package docvars holds only a test: the variable tables of the README
// (and the docs it links for a tier's own variables) and goext/config's
// variables agree, both ways.
package docvars
