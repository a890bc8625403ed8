package main

/*
#include <stdint.h>
*/
import "C"

import (
	"github.com/kvbm/kvbm/goext/config"
)

// kvbm_config_check parses and validates every kvbm environment variable and
// returns the effective configuration summary (or the errors, each naming its
// variable). requireTier != 0 also demands that G2 or G3 is configured.
//
//export kvbm_config_check
func kvbm_config_check(requireTier C.int, out **C.uint8_t, outLen *C.int64_t, errOut **C.char) (rc C.int) {
	defer guard(&rc, errOut)
	if err := healthy(); err != nil {
		return finish(err, errOut)
	}
	cfg, err := config.Load()
	if err != nil {
		return finish(withCode(statusConfig, err), errOut)
	}
	if requireTier != 0 {
		if err := cfg.Validate(); err != nil {
			return finish(withCode(statusConfig, err), errOut)
		}
	}
	cBuffer([]byte(cfg.Summary()), out, outLen)
	return statusOK
}
