package main

import (
	"log/slog"
	"os"
	"sync"

	"github.com/kvbm/kvbm/goext/config"
)

var (
	loggerOnce sync.Once
	logger     *slog.Logger
	logLevel   slog.LevelVar
)

// kvbmLogger is the library's logger: text to stderr (where engines log too),
// level from DYN_LOG (debug, info, warn, error; default info), as the process
// environment has it until a configuration sets it (applyLogLevel).
func kvbmLogger() *slog.Logger {
	loggerOnce.Do(func() {
		logLevel.Set(config.ProcessLogLevel())
		logger = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: &logLevel})).With("component", "kvbm")
	})
	return logger
}

// applyLogLevel sets the level from a configuration's DYN_LOG, when it has one.
func applyLogLevel(l config.LogLevel) {
	kvbmLogger()
	if l.Set {
		logLevel.Set(l.Level)
	}
}
