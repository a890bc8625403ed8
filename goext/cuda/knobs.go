package cuda

import (
	"fmt"
	"strconv"
	"strings"
)

// knob parses the value of a copier tuning variable (KVBM_CUDA_STAGING_MIB
// and the like, read where the C ABI gives no option for them): unset or
// empty → 0 (the default applies); a positive integer → that many units;
// anything else is an error naming the variable, so a typo fails the
// worker's start instead of silently running on the default.
func knob(name, value string, unit int64) (int64, error) {
	v := strings.TrimSpace(value)
	if v == "" {
		return 0, nil
	}
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil || n <= 0 || n > (1<<62)/unit {
		return 0, fmt.Errorf("cuda: %s=%q: want a positive integer", name, value)
	}
	return n * unit, nil
}
