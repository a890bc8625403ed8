package main

/*
#include "kvbm.h"
*/
import "C"

import (
	"encoding/json"

	"github.com/kvbm/kvbm/goext/config"
	"github.com/kvbm/kvbm/goext/zmqguard"
)

// loadConfig parses kvbm's configuration from env, the variables as the
// caller's runtime sees them (Python's os.environ). A Go library loaded with
// dlopen sees the process environment as of its load, which can miss
// variables set later; a nil env falls back to the process environment.
func loadConfig(env map[string]string) (cfg *config.Config, err error) {
	if env == nil {
		cfg, err = config.Load()
	} else {
		cfg, err = config.FromEnv(env)
	}
	if err == nil {
		// The ZeroMQ guard is process-wide: the last configuration loaded wins.
		zmqguard.Default().SetMaxMessageSize(uint64(cfg.ZMQMaxMessageMB) << 20)
	}
	return cfg, err
}

// parseOptions decodes an export's JSON options into v.
func parseOptions(export string, js *C.char, v any) error {
	if err := json.Unmarshal([]byte(C.GoString(js)), v); err != nil {
		return errorf(statusInvalid, "%s: options: %v", export, err)
	}
	return nil
}

// configFor applies the caller's DYN_LOG and parses its configuration;
// requireTier also demands that G2 or G3 is configured.
func configFor(env map[string]string, requireTier bool) (*config.Config, error) {
	cfg, err := loadConfig(env)
	if err != nil {
		return nil, withCode(statusConfig, err)
	}
	applyLogLevel(cfg.Log)
	log := kvbmLogger()
	cfg.WarnOnce(func(msg string) { log.Warn("kvbm: " + msg) })
	if requireTier {
		if err := cfg.Validate(); err != nil {
			return nil, withCode(statusConfig, err)
		}
	}
	return cfg, nil
}

// kvbm_config_check parses and validates every kvbm environment variable and
// returns the effective configuration summary (or the errors, each naming its
// variable). requireTier != 0 also demands that G2 or G3 is configured.
//
//export kvbm_config_check
func kvbm_config_check(envJSON *C.char, requireTier C.int, out **C.uint8_t, outLen *C.int64_t, errOut **C.char) (rc C.int) {
	defer guard(&rc, errOut)
	if err := healthy(); err != nil {
		return finish(err, errOut)
	}
	if err := checkOut("kvbm_config_check", ptr(out), ptr(outLen)); err != nil {
		return finish(err, errOut)
	}
	var env map[string]string
	if envJSON != nil {
		if err := json.Unmarshal([]byte(C.GoString(envJSON)), &env); err != nil {
			return finish(errorf(statusInvalid, "kvbm_config_check: environment: %v", err), errOut)
		}
	}
	cfg, err := loadConfig(env)
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
