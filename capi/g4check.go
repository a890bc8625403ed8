package main

import (
	"github.com/kvbm/kvbm/goext/config"
	"github.com/kvbm/kvbm/goext/node"
	"github.com/kvbm/kvbm/goext/object"
)

// g4StoreOptions completes the options of a G4 store the assembly opens
// (node.Deps.TuneStore): its bucket is checked in the background, never on
// the caller's thread. A variable so that tests can retry faster.
var g4StoreOptions = func(o *config.Object, so *object.StoreOptions) { node.DefaultStoreTuner(o, so) }
