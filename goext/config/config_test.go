package config

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func lookupMap(env map[string]string) func(string) (string, bool) {
	return func(k string) (string, bool) {
		v, ok := env[k]
		return v, ok
	}
}

func load(t *testing.T, env map[string]string) (*Config, error) {
	t.Helper()
	return FromLookup(lookupMap(env))
}

func TestDefaults(t *testing.T) {
	c, err := load(t, nil)
	require.NoError(t, err)
	require.Equal(t, &Config{
		DiskCacheDir:             "/tmp/",
		DiskAllocatorType:        "default",
		LeaderWorkerInitTimeout:  1800 * time.Second,
		LeaderWorkerLiveness:     10 * time.Second,
		LeaderZMQHost:            "127.0.0.1",
		LeaderZMQPubPort:         56001,
		LeaderZMQAckPort:         56002,
		LeaderRequestIdle:        10 * time.Minute,
		MaxConcurrentTransfers:   4,
		MaxTransferBatchSize:     16,
		MetricsPort:              6880,
		MetricsHost:              "127.0.0.1",
		MetricsMaxConnections:    64,
		MetricsReadHeaderTimeout: 5 * time.Second,
		MetricsReadTimeout:       10 * time.Second,
		MetricsWriteTimeout:      30 * time.Second,
		MetricsIdleTimeout:       30 * time.Second,
		CacheStatsMaxRequests:    1000,
		CacheStatsLogInterval:    5 * time.Second,
		EnableConsolidator:       true,
		ConsolidatorMode:         "dedup",
		NatsServer:               "nats://localhost:4222",
		ZMQMaxMessageMB:          64,
		Lifecycle:                Lifecycle{Admin: true},
		LoadPolicy:               LoadPolicy{Mode: LoadAlways},
		Admission:                Admission{Disk: AdmitFrequency, Object: AdmitAll},
	}, c)
	require.False(t, c.HostEnabled())
	require.False(t, c.DiskEnabled())
}

// Every variable: its valid forms and each kind of invalid value.
func TestVariables(t *testing.T) {
	type want func(t *testing.T, c *Config)
	type tc struct {
		name   string
		value  string
		check  want   // for valid values
		reason string // substring of the error for invalid values
	}
	num := func(get func(*Config) any, v any) want {
		return func(t *testing.T, c *Config) { require.Equal(t, v, get(c)) }
	}
	cases := map[string][]tc{}
	add := func(env string, cs ...tc) { cases[env] = append(cases[env], cs...) }

	for _, env := range []string{EnvCPUCacheGB, EnvDiskCacheGB} {
		get := func(c *Config) any { return c.CPUCacheGB }
		if env == EnvDiskCacheGB {
			get = func(c *Config) any { return c.DiskCacheGB }
		}
		add(env,
			// Small sizes: a disk tier size is also checked against the free
			// space of /tmp/, which a busy test machine may be short of.
			tc{name: "integer", value: "1", check: num(get, 1.0)},
			tc{name: "decimal", value: "0.5", check: num(get, 0.5)},
			tc{name: "spaces", value: " 0.25 ", check: num(get, 0.25)},
			tc{name: "zero is off", value: "0", check: num(get, 0.0)},
			tc{name: "unit suffix", value: "4GB", reason: "not a number"},
			tc{name: "negative", value: "-1", reason: "must not be negative"},
			tc{name: "nan", value: "NaN", reason: "finite"},
			tc{name: "inf", value: "+Inf", reason: "finite"},
			tc{name: "overflow", value: "1e400", reason: "out of range"},
			tc{name: "too large", value: "1e12", reason: "too large"},
		)
	}
	for _, env := range []string{EnvCPUCacheOverrideBlocks, EnvDiskCacheOverrideBlocks, EnvHostOffloadPrefixMinPriority} {
		get := map[string]func(*Config) any{
			EnvCPUCacheOverrideBlocks:       func(c *Config) any { return c.CPUCacheOverrideBlocks },
			EnvDiskCacheOverrideBlocks:      func(c *Config) any { return c.DiskCacheOverrideBlocks },
			EnvHostOffloadPrefixMinPriority: func(c *Config) any { return c.HostOffloadPrefixMinPriority },
		}[env]
		add(env,
			tc{name: "valid", value: "1024", check: num(get, 1024)},
			tc{name: "zero", value: "0", check: num(get, 0)},
			tc{name: "float", value: "1.5", reason: "not an integer"},
			tc{name: "word", value: "many", reason: "not an integer"},
			tc{name: "negative", value: "-3", reason: "must not be negative"},
			tc{name: "huge", value: "99999999999999999999", reason: "out of range"},
			tc{name: "beyond int32", value: "3000000000", reason: "at most"},
		)
	}
	for env, get := range map[string]func(*Config) any{
		EnvMaxConcurrentTransfers: func(c *Config) any { return c.MaxConcurrentTransfers },
		EnvMaxTransferBatchSize:   func(c *Config) any { return c.MaxTransferBatchSize },
		EnvConsolidatorMaxBlocks:  func(c *Config) any { return c.ConsolidatorMaxBlocks },
		EnvCacheStatsMaxRequests:  func(c *Config) any { return c.CacheStatsMaxRequests },
		EnvZMQMaxMessageMB:        func(c *Config) any { return c.ZMQMaxMessageMB },
		EnvMetricsMaxConnections:  func(c *Config) any { return c.MetricsMaxConnections },
	} {
		add(env,
			tc{name: "valid", value: "8", check: num(get, 8)},
			tc{name: "zero", value: "0", reason: "at least 1"},
			tc{name: "negative", value: "-1", reason: "must not be negative"},
			tc{name: "word", value: "four", reason: "not an integer"},
		)
	}
	for env, get := range map[string]func(*Config) any{
		EnvLeaderWorkerInitTimeoutSecs: func(c *Config) any { return c.LeaderWorkerInitTimeout },
		EnvLeaderWorkerLivenessSecs:    func(c *Config) any { return c.LeaderWorkerLiveness },
		EnvCacheStatsLogIntervalSecs:   func(c *Config) any { return c.CacheStatsLogInterval },
		// DYN_KVBM_METRICS_READ_HEADER_TIMEOUT_SECS: TestMetricsServerLimits
		// (it may not exceed the request timeout).
		EnvMetricsReadTimeoutSecs:  func(c *Config) any { return c.MetricsReadTimeout },
		EnvMetricsWriteTimeoutSecs: func(c *Config) any { return c.MetricsWriteTimeout },
		EnvMetricsIdleTimeoutSecs:  func(c *Config) any { return c.MetricsIdleTimeout },
	} {
		add(env,
			tc{name: "valid", value: "60", check: num(get, time.Minute)},
			tc{name: "zero", value: "0", reason: "at least 1"},
			tc{name: "negative", value: "-5", reason: "must not be negative"},
			tc{name: "duration syntax", value: "5s", reason: "not an integer"},
			tc{name: "overflow duration", value: "9300000000000", reason: "out of range"},
		)
	}
	for env, get := range map[string]func(*Config) any{
		EnvLeaderZMQPubPort: func(c *Config) any { return c.LeaderZMQPubPort },
		EnvLeaderZMQAckPort: func(c *Config) any { return c.LeaderZMQAckPort },
		EnvMetricsPort:      func(c *Config) any { return c.MetricsPort },
		EnvTrtllmZMQPort:    func(c *Config) any { return c.TrtllmZMQPort },
	} {
		add(env,
			tc{name: "valid", value: "5557", check: num(get, 5557)},
			tc{name: "max", value: "65535", check: num(get, 65535)},
			tc{name: "min", value: "1", check: num(get, 1)},
			tc{name: "zero", value: "0", reason: "port out of range"},
			tc{name: "too big", value: "65536", reason: "port out of range"},
			tc{name: "negative", value: "-80", reason: "must not be negative"},
			tc{name: "word", value: "http", reason: "not an integer"},
		)
	}
	for env, get := range map[string]func(*Config) any{
		EnvDiskDisableODirect:       func(c *Config) any { return c.DiskDisableODirect },
		EnvDisableDiskOffloadFilter: func(c *Config) any { return c.DisableDiskOffloadFilter },
		EnvMetrics:                  func(c *Config) any { return c.Metrics },
		EnvEnableConsolidator:       func(c *Config) any { return c.EnableConsolidator },
		EnvEnableNUMA:               func(c *Config) any { return c.EnableNUMA },
	} {
		for _, v := range []string{"1", "true", "TRUE", "On", "yes", " yes "} {
			add(env, tc{name: "true " + v, value: v, check: num(get, true)})
		}
		for _, v := range []string{"0", "false", "False", "OFF", "no"} {
			add(env, tc{name: "false " + v, value: v, check: num(get, false)})
		}
		for _, v := range []string{"2", "enabled", "y", "tru"} {
			add(env, tc{name: "bad " + v, value: v, reason: "not a boolean"})
		}
	}
	// Presence, any value, as Dynamo reads it.
	zf := func(c *Config) any { return c.DiskZerofillFallback }
	for _, v := range []string{"1", "0", "false", "anything"} {
		add(EnvDiskZerofillFallback, tc{name: "set " + v, value: v, check: num(zf, true)})
	}
	add(EnvDiskZerofillFallback, tc{name: "blank", value: " ", check: num(zf, false)})
	mode := func(c *Config) any { return c.ConsolidatorMode }
	add(EnvConsolidatorMode,
		tc{name: "dedup", value: "dedup", check: num(mode, "dedup")},
		tc{name: "passthrough", value: "passthrough", check: num(mode, "passthrough")},
		tc{name: "unknown", value: "pass-through", reason: "must be one of dedup, passthrough"},
	)
	alloc := func(c *Config) any { return c.DiskAllocatorType }
	add(EnvDiskAllocatorType,
		tc{name: "default", value: "default", check: num(alloc, "default")},
		tc{name: "open-direct", value: " open-direct ", check: num(alloc, "open-direct")},
		tc{name: "unknown", value: "gds", reason: "must be one of default, open-direct"},
		tc{name: "case", value: "Open-Direct", reason: "must be one of default, open-direct"},
	)
	add(EnvDiskCacheDir, tc{name: "valid", value: "/x-10.0.0.2", check: num(func(c *Config) any { return c.DiskCacheDir }, "/x-10.0.0.2")})
	for env, host := range map[string]func(*Config) any{
		EnvLeaderZMQHost: func(c *Config) any { return c.LeaderZMQHost },
		EnvMetricsHost:   func(c *Config) any { return c.MetricsHost },
	} {
		add(env,
			tc{name: "ip", value: "10.0.0.2", check: num(host, "10.0.0.2")},
			tc{name: "any", value: "0.0.0.0", check: num(host, "0.0.0.0")},
			tc{name: "ipv6", value: "::1", check: num(host, "::1")},
			tc{name: "name", value: "node-3.cluster.local", check: num(host, "node-3.cluster.local")},
			tc{name: "path", value: "/x-10.0.0.2", reason: "not an IP address or host name"},
			tc{name: "url", value: "tcp://10.0.0.2", reason: "not an IP address or host name"},
			tc{name: "port", value: "10.0.0.2:5555", reason: "not an IP address or host name"},
			tc{name: "dash", value: "-node", reason: "starts or ends with '-'"},
		)
	}
	nats := func(c *Config) any { return c.NatsServer }
	add(EnvNatsServer,
		tc{name: "url", value: "nats://10.0.0.2:4222", check: num(nats, "nats://10.0.0.2:4222")},
		tc{name: "tls", value: "tls://nats.example.com", check: num(nats, "tls://nats.example.com")},
		tc{name: "no scheme", value: "nats-0:4222", check: num(nats, "nats-0:4222")},
		tc{name: "list", value: "nats://a:4222, nats://b:4222", check: num(nats, "nats://a:4222, nats://b:4222")},
		tc{name: "path", value: "/x-10.0.0.2", reason: "no host"},
		tc{name: "scheme", value: "http://10.0.0.2:4222", reason: `scheme "http"`},
		tc{name: "port", value: "nats://a:99999", reason: "out of range"},
		tc{name: "empty in list", value: "nats://a:4222,", reason: "empty URL"},
	)

	for env, list := range cases {
		for _, c := range list {
			t.Run(env+"/"+c.name, func(t *testing.T) {
				cfg, err := load(t, map[string]string{env: c.value})
				if c.check != nil {
					require.NoError(t, err)
					c.check(t, cfg)
					return
				}
				require.Error(t, err)
				require.Nil(t, cfg)
				// The message names the variable and quotes the value.
				require.Contains(t, err.Error(), "invalid "+env+"=\""+c.value+"\": ")
				require.Contains(t, err.Error(), c.reason)
				var ve *VarError
				require.ErrorAs(t, err, &ve)
				require.Equal(t, env, ve.Name)
				require.Equal(t, c.value, ve.Value)
			})
		}
	}
}

func TestEmptyMeansUnset(t *testing.T) {
	env := map[string]string{}
	for _, name := range []string{EnvCPUCacheGB, EnvMaxConcurrentTransfers, EnvMetricsPort, EnvEnableConsolidator,
		EnvNatsServer, EnvDiskCacheDir, EnvLeaderWorkerInitTimeoutSecs, EnvTrtllmZMQPort} {
		env[name] = ""
	}
	env[EnvMetrics] = "   "
	c, err := load(t, env)
	require.NoError(t, err)
	def, err := load(t, nil)
	require.NoError(t, err)
	require.Equal(t, def, c)
}

func TestAllErrorsReportedTogether(t *testing.T) {
	_, err := load(t, map[string]string{
		EnvCPUCacheGB:             "lots",
		EnvMetricsPort:            "99999",
		EnvMetrics:                "maybe",
		EnvMaxConcurrentTransfers: "-2",
	})
	require.Error(t, err)
	msg := err.Error()
	for _, s := range []string{
		`invalid DYN_KVBM_CPU_CACHE_GB="lots"`,
		`invalid DYN_KVBM_METRICS_PORT="99999"`,
		`invalid DYN_KVBM_METRICS="maybe"`,
		`invalid DYN_KVBM_MAX_CONCURRENT_TRANSFERS="-2"`,
	} {
		require.Contains(t, msg, s)
	}
	require.Len(t, err.(interface{ Unwrap() []error }).Unwrap(), 4)
}

// The metrics endpoint's connection cap is bounded by a fixed maximum and by
// the process's open-file limit, and its header timeout by its request
// timeout; each refusal names the variable.
func TestMetricsServerLimits(t *testing.T) {
	_, err := load(t, map[string]string{EnvMetricsMaxConnections: "5000"})
	requireVarError(t, err, EnvMetricsMaxConnections, "at most 4096")

	old := openFilesLimit
	t.Cleanup(func() { openFilesLimit = old })
	openFilesLimit = func() (uint64, bool) { return 256, true }
	c, err := load(t, map[string]string{EnvMetricsMaxConnections: "128"})
	require.NoError(t, err)
	require.Equal(t, 128, c.MetricsMaxConnections)
	_, err = load(t, map[string]string{EnvMetricsMaxConnections: "129"})
	requireVarError(t, err, EnvMetricsMaxConnections, "open-file limit (256)")
	openFilesLimit = func() (uint64, bool) { return 16, true }
	_, err = load(t, nil)
	require.NoError(t, err, "the default is not held against the limit")

	for value, reason := range map[string]string{"0": "at least 1", "-5": "must not be negative", "5s": "not an integer"} {
		_, err = load(t, map[string]string{EnvMetricsReadHeaderTimeoutSecs: value})
		requireVarError(t, err, EnvMetricsReadHeaderTimeoutSecs, reason)
	}
	c, err = load(t, map[string]string{EnvMetricsReadHeaderTimeoutSecs: "2"})
	require.NoError(t, err)
	require.Equal(t, 2*time.Second, c.MetricsReadHeaderTimeout)
	_, err = load(t, map[string]string{EnvMetricsReadHeaderTimeoutSecs: "20"})
	requireVarError(t, err, EnvMetricsReadHeaderTimeoutSecs, "must not exceed "+EnvMetricsReadTimeoutSecs)
	c, err = load(t, map[string]string{EnvMetricsReadHeaderTimeoutSecs: "20", EnvMetricsReadTimeoutSecs: "20"})
	require.NoError(t, err)
	require.Equal(t, 20*time.Second, c.MetricsReadHeaderTimeout)
}

func TestLeaderPortsMustDiffer(t *testing.T) {
	_, err := load(t, map[string]string{EnvLeaderZMQPubPort: "6000", EnvLeaderZMQAckPort: "6000"})
	require.ErrorContains(t, err, `invalid DYN_KVBM_LEADER_ZMQ_ACK_PORT="6000": must differ`)
	_, err = load(t, map[string]string{EnvLeaderZMQAckPort: "56001"}) // collides with the default pub port
	require.Error(t, err)
	// A bad pub port is reported once, not again as a collision.
	_, err = load(t, map[string]string{EnvLeaderZMQPubPort: "x", EnvLeaderZMQAckPort: "56001"})
	require.Len(t, err.(interface{ Unwrap() []error }).Unwrap(), 1)
}

func TestBlocks(t *testing.T) {
	for _, tc := range []struct {
		name          string
		gb            float64
		override      int
		bytesPerBlock int64
		want          int
	}{
		// 1 GB is 10⁹ bytes, not 2³⁰.
		{name: "decimal GB", gb: 1, bytesPerBlock: 1_000_000, want: 1000},
		{name: "fractional GB", gb: 0.5, bytesPerBlock: 1_000_000, want: 500},
		{name: "floor", gb: 1, bytesPerBlock: 3_000_000, want: 333},
		// 2.01·10⁹ is 2009999999.9999998 as a float64 product; an exact multiple must not lose a block.
		{name: "float rounding", gb: 2.01, bytesPerBlock: 2_010_000, want: 1000},
		{name: "override wins", gb: 100, override: 7, bytesPerBlock: 1_000_000, want: 7},
		{name: "override without GB", override: 12, bytesPerBlock: 1, want: 12},
		// Budget is the total across workers: a 2 MiB block per layer-set on 4 TP ranks costs 8 MiB.
		{name: "total across workers", gb: 8, bytesPerBlock: 4 * 2 * 1024 * 1024, want: 953},
		{name: "unset", bytesPerBlock: 1, want: 0},
		{name: "bad block size", gb: 1, bytesPerBlock: 0, want: 0},
		{name: "block bigger than budget", gb: 0.001, bytesPerBlock: 2_000_000, want: 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := &Config{CPUCacheGB: tc.gb, CPUCacheOverrideBlocks: tc.override,
				DiskCacheGB: tc.gb, DiskCacheOverrideBlocks: tc.override}
			require.Equal(t, tc.want, c.HostBlocks(tc.bytesPerBlock))
			require.Equal(t, tc.want, c.DiskBlocks(tc.bytesPerBlock))
		})
	}
}

func TestValidate(t *testing.T) {
	c, err := load(t, nil)
	require.NoError(t, err)
	err = c.Validate()
	require.ErrorIs(t, err, ErrNoTier)
	require.ErrorContains(t, err, EnvCPUCacheGB)
	require.ErrorContains(t, err, EnvDiskCacheGB)

	for _, env := range []map[string]string{
		{EnvCPUCacheGB: "1"},
		{EnvCPUCacheOverrideBlocks: "10"},
		{EnvDiskCacheGB: "1", EnvDiskCacheDir: t.TempDir()},
		{EnvDiskCacheOverrideBlocks: "10", EnvDiskCacheDir: t.TempDir()},
	} {
		c, err := load(t, env)
		require.NoError(t, err)
		require.NoError(t, c.Validate(), "%v", env)
	}
}

func TestDiskDir(t *testing.T) {
	base := t.TempDir()
	file := filepath.Join(base, "regular-file")
	require.NoError(t, os.WriteFile(file, nil, 0o644))

	t.Run("created when missing", func(t *testing.T) {
		dir := filepath.Join(base, "a", "b")
		c, err := load(t, map[string]string{EnvDiskCacheGB: "1", EnvDiskCacheDir: dir})
		require.NoError(t, err)
		require.True(t, c.DiskEnabled())
		st, err := os.Stat(dir)
		require.NoError(t, err)
		require.True(t, st.IsDir())
		entries, err := os.ReadDir(dir)
		require.NoError(t, err)
		require.Empty(t, entries, "write check must clean up after itself")
	})
	t.Run("path under a regular file", func(t *testing.T) {
		// chmod would not stop root, so use a path that cannot be a directory.
		bad := filepath.Join(file, "cache")
		_, err := load(t, map[string]string{EnvDiskCacheOverrideBlocks: "100", EnvDiskCacheDir: bad})
		require.ErrorContains(t, err, `invalid DYN_KVBM_DISK_CACHE_DIR="`+bad+`": cannot create directory`)
	})
	t.Run("path is a regular file", func(t *testing.T) {
		_, err := load(t, map[string]string{EnvDiskCacheGB: "2", EnvDiskCacheDir: file})
		require.ErrorContains(t, err, "invalid DYN_KVBM_DISK_CACHE_DIR=")
	})
	t.Run("not checked when disk tier off", func(t *testing.T) {
		c, err := load(t, map[string]string{EnvDiskCacheDir: filepath.Join(file, "cache")})
		require.NoError(t, err)
		require.False(t, c.DiskEnabled())
	})
}

func TestLoadFromEnvironment(t *testing.T) {
	t.Setenv(EnvCPUCacheGB, "3")
	t.Setenv(EnvMetrics, "yes")
	c, err := Load()
	require.NoError(t, err)
	require.Equal(t, 3.0, c.CPUCacheGB)
	require.True(t, c.Metrics)
}

func TestSummaryAndLogOnce(t *testing.T) {
	c, err := load(t, map[string]string{
		EnvCPUCacheGB: "4", EnvDiskCacheOverrideBlocks: "500", EnvDiskCacheDir: t.TempDir(),
		EnvMetrics: "1", EnvTrtllmZMQPort: "5557",
	})
	require.NoError(t, err)
	s := c.Summary()
	for _, want := range []string{"host (G2) tier: 4 GB", "disk (G3) tier: 500 blocks (override)",
		"metrics: on, 127.0.0.1:6880/metrics", "trtllm zmq port 5557", "nats://localhost:4222",
		"4 concurrent batches of up to 16 blocks", "worker init timeout 30m0s"} {
		require.Contains(t, s, want)
	}
	require.Greater(t, strings.Count(s, "\n"), 5)

	def, err := load(t, nil)
	require.NoError(t, err)
	require.Contains(t, def.Summary(), "host (G2) tier: disabled")
	require.Contains(t, def.Summary(), "metrics: off")

	var logged []string
	logf := func(format string, args ...any) { logged = append(logged, format) }
	logOnce = sync.Once{} // once per process: start this test's process afresh (-count=N)
	c.LogOnce(logf)
	def.LogOnce(logf)
	c.LogOnce(logf)
	require.Len(t, logged, 1)
}

func TestVarErrorIsErrorsAsable(t *testing.T) {
	_, err := load(t, map[string]string{EnvMetricsPort: "0"})
	var ve *VarError
	require.True(t, errors.As(err, &ve))
	require.Equal(t, `config: invalid DYN_KVBM_METRICS_PORT="0": port out of range 1..65535`, ve.Error())
}

// TestUnsupportedVariablesWarn: Dynamo variables kvbm does not act on are
// accepted, each with one warning naming it and saying what kvbm does.
func TestUnsupportedVariablesWarn(t *testing.T) {
	for _, tc := range []struct {
		env  map[string]string
		want []string // substrings, one warning each
	}{
		{env: nil},
		{env: map[string]string{EnvNcclMLAMode: "false"}},
		{env: map[string]string{EnvNcclMLAMode: "true"}, want: []string{EnvNcclMLAMode + " is on but kvbm has no NCCL replicated mode"}},
		{env: map[string]string{EnvNcclMLAMode: "yes"}, want: []string{"sharded mode"}},
		{env: map[string]string{EnvNcclMaxCTAs: "8"}, want: []string{EnvNcclMaxCTAs + `="8" is ignored: kvbm uses no NCCL`}},
		{env: map[string]string{EnvTransferBatchSize: "32", EnvMaxTransferBatchSize: "8"},
			want: []string{EnvTransferBatchSize + `="32" is ignored (a KVBM v2 setting): kvbm's transfer batch size is ` +
				EnvMaxTransferBatchSize + " (8)"}},
		{env: map[string]string{"DYN_KVBM_NIXL_BACKEND_UCX": "true", "DYN_KVBM_NIXL_BACKEND_GDS_MT": "false"},
			want: []string{"DYN_KVBM_NIXL_BACKEND_GDS_MT is ignored: kvbm moves blocks without NIXL",
				"DYN_KVBM_NIXL_BACKEND_UCX is ignored"}},
	} {
		c, err := FromEnv(tc.env)
		require.NoError(t, err, "%v", tc.env)
		require.Len(t, c.Warnings, len(tc.want), "%v: %q", tc.env, c.Warnings)
		for _, w := range tc.want {
			found := false
			for _, got := range c.Warnings {
				found = found || strings.Contains(got, w)
			}
			require.True(t, found, "%v: no warning with %q in %q", tc.env, w, c.Warnings)
		}
	}
	// Not a boolean: an error naming the variable, as for every boolean.
	_, err := FromEnv(map[string]string{EnvNcclMLAMode: "maybe"})
	requireVarError(t, err, EnvNcclMLAMode, "not a boolean")

	var logged []string
	c, err := FromEnv(map[string]string{EnvNcclMaxCTAs: "8"})
	require.NoError(t, err)
	warnOnce = sync.Once{} // a fresh process, whatever ran before in this one (go test -count)
	c.WarnOnce(func(m string) { logged = append(logged, m) })
	c.WarnOnce(func(m string) { logged = append(logged, m) })
	require.Len(t, logged, 1, "once per process")
}

// TestLifecycleSettings: TTLs in whole seconds up to ten years (0: off),
// the endpoint on by default; bad values name their variable.
func TestLifecycleSettings(t *testing.T) {
	c, err := load(t, map[string]string{EnvObjectTTLSecs: "86400", EnvDiskTTLSecs: "0", EnvAdmin: "false",
		EnvAdminDir: "/run/kvbm-x"})
	require.NoError(t, err)
	require.Equal(t, Lifecycle{ObjectTTL: 24 * time.Hour, AdminDir: "/run/kvbm-x"}, c.Lifecycle)
	for name, v := range map[string]string{EnvObjectTTLSecs: "-1", EnvDiskTTLSecs: "315360001", EnvAdmin: "maybe"} {
		_, err := load(t, map[string]string{name: v})
		require.ErrorContains(t, err, name)
	}
}
