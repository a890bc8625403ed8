package wire

import (
	"bytes"
	"errors"
	"io/fs"
	"os"
	"strconv"
)

// ownPidNS identifies this process's PID namespace ("pid:[4026531836]"),
// empty where /proc does not say.
var ownPidNS = pidNamespace()

func pidNamespace() string {
	ns, err := os.Readlink("/proc/self/ns/pid")
	if err != nil {
		return ""
	}
	return ns
}

// processGone reports whether the worker process pid, which reported PID
// namespace ns, has certainly exited: it must share this process's PID
// namespace (a pid from another container means nothing here), and
// /proc/<pid> must be absent or a zombie. Anything uncertain is "not gone":
// such a rank stays suspected, never wrongly dead.
func processGone(pid int, ns string) bool {
	if pid <= 0 || ns == "" || ns != ownPidNS {
		return false
	}
	stat, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if errors.Is(err, fs.ErrNotExist) {
		return true
	}
	if err != nil {
		return false
	}
	// "pid (comm) S ...": the state follows the last ')' (comm may hold ')').
	i := bytes.LastIndexByte(stat, ')')
	if i < 0 || i+2 >= len(stat) {
		return false
	}
	switch stat[i+2] {
	case 'Z', 'X', 'x':
		return true
	}
	return false
}
