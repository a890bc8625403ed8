// Package envread holds only a test: no Go file of kvbm outside
// goext/config reads the environment (os.Getenv, os.LookupEnv,
// os.Environ), so every setting is parsed, validated and documented in one
// place (config.Config) and kvbm_config_check sees them all.
package envread
