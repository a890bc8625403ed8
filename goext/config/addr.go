package config

import (
	"net"
	"net/url"
	"strconv"
	"strings"
)

// host reads a host name or IP address (DYN_KVBM_LEADER_ZMQ_HOST).
func (p *parser) host(name, def string) string {
	v := p.str(name, def)
	if v == def {
		return v
	}
	if reason := checkHost(v); reason != "" {
		p.fail(name, v, reason)
	}
	return v
}

// checkHost returns why h is not an IP address or an RFC 1123 host name ("" if it is).
func checkHost(h string) string {
	if net.ParseIP(strings.Trim(h, "[]")) != nil {
		return ""
	}
	if len(h) > 253 {
		return "not a host name: longer than 253 characters"
	}
	for _, label := range strings.Split(strings.TrimSuffix(h, "."), ".") {
		if label == "" || len(label) > 63 {
			return "not an IP address or host name: empty or over-long label"
		}
		if label[0] == '-' || label[len(label)-1] == '-' {
			return "not an IP address or host name: a label starts or ends with '-'"
		}
		for _, c := range label {
			if !(c == '-' || c >= '0' && c <= '9' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z') {
				return "not an IP address or host name: character " + strconv.QuoteRune(c)
			}
		}
	}
	return ""
}

// natsURLs reads NATS_SERVER: one URL or a comma-separated list, each
// nats://, tls://, ws:// or wss:// with a host and an optional port. A URL
// without a scheme is taken as nats:// (as the NATS client does).
func (p *parser) natsURLs(name, def string) string {
	v := p.str(name, def)
	if v == def {
		return v
	}
	for _, raw := range strings.Split(v, ",") {
		if reason := checkNatsURL(strings.TrimSpace(raw)); reason != "" {
			p.fail(name, v, reason)
			break
		}
	}
	return v
}

func checkNatsURL(raw string) string {
	if raw == "" {
		return "empty URL in the list"
	}
	if !strings.Contains(raw, "://") {
		raw = "nats://" + raw
	}
	u, err := url.Parse(raw)
	if err != nil {
		return "not a URL: " + err.Error()
	}
	switch u.Scheme {
	case "nats", "tls", "ws", "wss":
	default:
		return "scheme " + strconv.Quote(u.Scheme) + ": want nats://, tls://, ws:// or wss://"
	}
	if u.Hostname() == "" {
		return "no host in " + strconv.Quote(raw)
	}
	if reason := checkHost(u.Hostname()); reason != "" {
		return reason
	}
	if port := u.Port(); port != "" {
		if n, err := strconv.Atoi(port); err != nil || n < 1 || n > 65535 {
			return "port " + strconv.Quote(port) + " out of range 1..65535"
		}
	}
	if u.Path != "" && u.Path != "/" {
		return "unexpected path " + strconv.Quote(u.Path)
	}
	return ""
}
