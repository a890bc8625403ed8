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
)

// kvbmLogger is the library's logger: text to stderr (where engines log too),
// level from DYN_LOG (debug, info, warn, error; default info).
func kvbmLogger() *slog.Logger {
	loggerOnce.Do(func() {
		level := slog.LevelInfo
		switch strings.ToLower(strings.TrimSpace(os.Getenv("DYN_LOG"))) {
		case "debug", "trace":
			level = slog.LevelDebug
		case "warn", "warning":
			level = slog.LevelWarn
		case "error":
			level = slog.LevelError
		}
		logger = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level})).With("component", "kvbm")
	})
	return logger
}
