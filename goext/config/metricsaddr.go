package config

import (
	"net"
	"strconv"
	"strings"
)

// MetricsAddr is the metrics endpoint's host:port (DYN_KVBM_METRICS_HOST,
// DYN_KVBM_METRICS_PORT), brackets around an IPv6 address as net.Listen
// wants them.
func (c *Config) MetricsAddr() string {
	return net.JoinHostPort(strings.Trim(c.MetricsHost, "[]"), strconv.Itoa(c.MetricsPort))
}
