package bench

import (
	"context"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// meter measures CPU time used while a worker runs.
type meter struct {
	start         time.Time
	self          time.Duration
	redis, pg     time.Duration
	serversViable bool
	host          time.Duration
	hostViable    bool
	// wal is where Postgres's write-ahead log stood at the start; empty
	// when not measured.
	wal string
	pg0 *pgxpool.Pool
}

// startMeter starts measuring; with db it also measures the WAL Postgres
// writes (the whole cluster's: other databases' writes count too, as other
// processes' CPU does).
func startMeter(db *pgxpool.Pool) *meter {
	m := &meter{start: time.Now(), self: processCPU(), pg0: db}
	if db != nil {
		if db.QueryRow(context.Background(), `SELECT pg_current_wal_lsn()::text`).Scan(&m.wal) != nil {
			m.wal = ""
		}
	}
	m.redis, m.pg, m.serversViable = serverCPU()
	m.host, m.hostViable = hostCPU()
	return m
}

func (m *meter) stop(p *Phase) {
	wall := time.Since(m.start)
	n := float64(p.Jobs)
	ms := func(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) / n }
	self := processCPU() - m.self
	p.WorkerCPUms = ms(self)
	if m.wal != "" {
		var bytes float64
		if m.pg0.QueryRow(context.Background(), `SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), $1::pg_lsn)::float8`, m.wal).Scan(&bytes) == nil {
			p.PostgresWALBytes = bytes / n
		}
	}
	redis, pg, ok := serverCPU()
	if !ok || !m.serversViable {
		return
	}
	redis, pg = redis-m.redis, pg-m.pg
	// A server that exits meanwhile (a private redis-server) takes its time
	// with it: never below 0.
	p.RedisCPUms = max(0, ms(redis))
	p.PostgresCPUms = max(0, ms(pg))
	if host, ok := hostCPU(); ok && m.hostViable && wall > 0 {
		other := host - m.host - self - redis - pg
		p.OtherCores = max(0, float64(other)/float64(wall))
	}
}

// ProcessCPU is the CPU time this process has used so far (0 where the
// system does not tell).
func ProcessCPU() time.Duration { return processCPU() }

// ServerCPU is the CPU time the redis-server and postgres processes visible
// in /proc have used so far (ok is false where there is no /proc or neither
// server runs on this host). Take it before and after a measurement.
func ServerCPU() (redis, postgres time.Duration, ok bool) { return serverCPU() }

// hostCPU is the busy time of all CPUs of the host, from /proc/stat.
func hostCPU() (time.Duration, bool) {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0, false
	}
	line, _, _ := strings.Cut(string(b), "\n")
	f := strings.Fields(line)
	if len(f) < 5 || f[0] != "cpu" {
		return 0, false
	}
	var busy int64
	for i, v := range f[1:] {
		if i == 3 || i == 4 { // idle, iowait
			continue
		}
		if i >= 8 { // guest times are already in user
			break
		}
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil {
			return 0, false
		}
		busy += n
	}
	return time.Duration(busy) * time.Second / clockTick, true
}

// clockTick is USER_HZ, the unit of /proc/<pid>/stat times (100 on Linux
// for every architecture Go supports).
const clockTick = 100

// serverCPU sums the CPU time of the redis-server and postgres processes
// visible in /proc (all of them: other clients' work is counted too),
// with that of the children they reaped: a backend that exits (a pool
// closed before the meter stops) takes its time to the postmaster's
// children's time, not out of the total. It reports ok = false where there
// is no /proc or neither server runs on this host.
func serverCPU() (redis, pg time.Duration, ok bool) { return serverCPUOf(nil) }

// serverCPUOf is serverCPU over the processes keep (given each one's pid
// and its parent's) keeps; nil keeps all.
func serverCPUOf(keep func(pid, ppid int) bool) (redis, pg time.Duration, ok bool) {
	dirs, err := filepath.Glob("/proc/[0-9]*/stat")
	if err != nil || len(dirs) == 0 {
		return 0, 0, false
	}
	for _, f := range dirs {
		b, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		s := string(b)
		open, end := strings.IndexByte(s, '('), strings.LastIndexByte(s, ')')
		if open < 0 || end < open {
			continue
		}
		comm := s[open+1 : end]
		var into *time.Duration
		switch {
		case comm == "redis-server":
			into = &redis
		case comm == "postgres" || strings.HasPrefix(comm, "postgres:"):
			into = &pg
		default:
			continue
		}
		fields := strings.Fields(s[end+1:])
		// After the comm: state is field 3; utime and stime are 14 and
		// 15, then the times of reaped children, cutime and cstime.
		if len(fields) < 15 {
			continue
		}
		if keep != nil {
			pid, _ := strconv.Atoi(filepath.Base(filepath.Dir(f)))
			ppid, _ := strconv.Atoi(fields[1])
			if !keep(pid, ppid) {
				continue
			}
		}
		var ticks int64
		for _, f := range fields[11:15] {
			n, err := strconv.ParseInt(f, 10, 64)
			if err != nil {
				ticks = -1
				break
			}
			ticks += n
		}
		if ticks < 0 {
			continue
		}
		*into += time.Duration(ticks) * time.Second / clockTick
		ok = true
	}
	return redis, pg, ok
}

// noise measures the CPU time that other processes of the host use: not
// this one, its children (child workers, a private redis-server) once they
// have exited, Redis or Postgres.
type noise struct {
	start                 time.Time
	host, self, redis, pg time.Duration
	ok                    bool
}

func startNoise() *noise {
	n := &noise{start: time.Now(), self: processCPU() + childrenCPU()}
	var hostOK, serversOK bool
	n.host, hostOK = hostCPU()
	n.redis, n.pg, serversOK = serverCPU()
	n.ok = hostOK && serversOK
	return n
}

// stop returns how many cores the others kept busy on average, or -1 when
// that cannot be known here.
func (n *noise) stop() float64 {
	wall := time.Since(n.start)
	host, hostOK := hostCPU()
	redis, pg, serversOK := serverCPU()
	if !n.ok || !hostOK || !serversOK || wall <= 0 {
		return -1
	}
	self := processCPU() + childrenCPU() - n.self
	other := (host - n.host) - self - (redis - n.redis) - (pg - n.pg)
	return max(0, float64(other)/float64(wall))
}

// Noise measures how many cores the host's other processes keep busy: not
// this process, Redis or Postgres. bench/river reports it as keel bench
// does, since figures from a busy host measure the host.
type Noise struct{ n *noise }

// StartNoise starts measuring.
func StartNoise() Noise { return Noise{startNoise()} }

// Stop returns how many cores the others kept busy on average since
// StartNoise, or -1 when that cannot be known here.
func (n Noise) Stop() float64 { return n.n.stop() }
