// Command metricsflood measures what a scrape flood costs the process that
// serves kvbm's /metrics endpoint: a child process serves a metrics set
// (goext/metrics) with the default per-client rate limit, or with -unlimited
// a rate no client reaches (the endpoint as it was), and the parent floods
// it from one client with -clients keep-alive connections for -seconds. It
// prints the scrapes answered per second, how many were 200 and 429, and the
// CPU the serving process used (cores, from /proc/<pid>/stat).
//
//	go run ./bench/metricsflood [-unlimited] [-clients 8] [-seconds 3]
package main

import (
	"bufio"
	"flag"
	"fmt"
	"io"
	"log"
	"net/http"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvbm/kvbm/goext/metrics"
)

func main() {
	serve := flag.Bool("serve", false, "(child) serve the endpoint and print its address")
	unlimited := flag.Bool("unlimited", false, "no effective rate limit (the endpoint as it was)")
	clients := flag.Int("clients", 8, "concurrent keep-alive connections of the flooding client")
	seconds := flag.Float64("seconds", 3, "flood duration")
	flag.Parse()
	if *serve {
		o := metrics.ServerOptions{}
		if *unlimited {
			o.ScrapesPerSecond, o.ScrapeBurst = 1e12, 1<<30
		}
		s, err := metrics.New().ServeWith("127.0.0.1:0", o)
		check(err)
		fmt.Println(s.Addr)
		select {}
	}

	args := []string{"-serve"}
	if *unlimited {
		args = append(args, "-unlimited")
	}
	child := exec.Command(os.Args[0], args...)
	child.Stderr = os.Stderr
	out, err := child.StdoutPipe()
	check(err)
	check(child.Start())
	defer func() { _ = child.Process.Kill(); _ = child.Wait() }()
	addr, err := bufio.NewReader(out).ReadString('\n')
	check(err)
	url := "http://" + strings.TrimSpace(addr) + "/metrics"

	tr := &http.Transport{MaxIdleConnsPerHost: *clients}
	client := &http.Client{Transport: tr, Timeout: 5 * time.Second}
	var ok, limited, other atomic.Int64
	cpu0 := cpuSeconds(child.Process.Pid)
	start := time.Now()
	end := start.Add(time.Duration(*seconds * float64(time.Second)))
	var wg sync.WaitGroup
	for range *clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for time.Now().Before(end) {
				resp, err := client.Get(url)
				if err != nil {
					other.Add(1)
					continue
				}
				_, _ = io.Copy(io.Discard, resp.Body)
				_ = resp.Body.Close()
				switch resp.StatusCode {
				case http.StatusOK:
					ok.Add(1)
				case http.StatusTooManyRequests:
					limited.Add(1)
				default:
					other.Add(1)
				}
			}
		}()
	}
	wg.Wait()
	wall := time.Since(start).Seconds()
	cpu := cpuSeconds(child.Process.Pid) - cpu0
	total := ok.Load() + limited.Load() + other.Load()
	fmt.Printf("unlimited=%v: %.0f scrapes/s (200: %d, 429: %d, other: %d); serving process %.2f cores, %.1f µs CPU per scrape\n",
		*unlimited, float64(total)/wall, ok.Load(), limited.Load(), other.Load(), cpu/wall, cpu/float64(total)*1e6)
}

// cpuSeconds is a process's user + system CPU time.
func cpuSeconds(pid int) float64 {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	check(err)
	// Fields after the command name (which may hold spaces): utime and
	// stime are the 12th and 13th of those.
	f := strings.Fields(string(b[strings.LastIndexByte(string(b), ')')+2:]))
	ut, err := strconv.ParseFloat(f[11], 64)
	check(err)
	st, err := strconv.ParseFloat(f[12], 64)
	check(err)
	return (ut + st) / 100 // USER_HZ: 100 on Linux
}

func check(err error) {
	if err != nil {
		log.Fatal(err)
	}
}
