package main

import (
	"log/slog"
	"os"
	"strings"
	"sync"
)

var (
	loggerOnce sync.Once
	logger     *slog.Logger
	logLevel   slog.LevelVar
)

// kvbmLogger is the library's logger: text to stderr (where engines log too),
// level from DYN_LOG (debug, info, warn, error; default info).
func kvbmLogger() *slog.Logger {
	loggerOnce.Do(func() {
		logLevel.Set(parseLevel(os.Getenv("DYN_LOG")))
		logger = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: &logLevel})).With("component", "kvbm")
	})
	return logger
}

// applyLogEnv sets the level from the caller's DYN_LOG, when it passed one.
func applyLogEnv(env map[string]string) {
	kvbmLogger()
	if v, ok := env["DYN_LOG"]; ok {
		logLevel.Set(parseLevel(v))
	}
}

func parseLevel(s string) slog.Level {
	switch strings.ToLower(strings.TrimSpace(s)) {
	case "debug", "trace":
		return slog.LevelDebug
	case "warn", "warning":
		return slog.LevelWarn
	case "error":
		return slog.LevelError
	}
	return slog.LevelInfo
}
