//go:build !unix

package bench

import "time"

func processCPU() time.Duration { return 0 }
