// Package errprefix holds only a test: every error string a goext package
// creates starts with that package's prefix ("storage: ", "cuda: ", ...), so
// a message names where it came from.
package errprefix
