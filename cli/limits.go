package cli

import (
	"fmt"
	"log/slog"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/keeljobs/keel/flow"
)

// limitFlags are the worker's flow-control rules.
type limitFlags struct {
	concurrency []string
	rates       []string
}

func (l *limitFlags) bind(cmd *cobra.Command) {
	f := cmd.Flags()
	f.StringSliceVar(&l.concurrency, "concurrency-limit", splitEnv("KEEL_CONCURRENCY_LIMITS"),
		"cluster-wide limit on jobs running at once: KIND=N, repeatable (env KEEL_CONCURRENCY_LIMITS, comma-separated)")
	f.StringSliceVar(&l.rates, "rate-limit", splitEnv("KEEL_RATE_LIMITS"),
		"cluster-wide start rate: KIND=RATE/PERIOD[:BURST], e.g. mail:send=50/1s, repeatable (env KEEL_RATE_LIMITS, comma-separated)")
}

func splitEnv(name string) []string {
	v := strings.TrimSpace(os.Getenv(name))
	if v == "" {
		return nil
	}
	return strings.Split(v, ",")
}

// ruleKinds gives a rule named after a kind this worker handles that kind
// (a program need not declare its kinds, and rules reads only the declared
// ones), and warns of a rule that names no kind handled here: the worker's
// flow controller is its own, which no handler can Take from, so such a
// rule limits nothing in it (a misspelt kind, or a resource, which needs a
// controller the program makes with flow.New).
func ruleKinds(log *slog.Logger, rules []flow.Rule, handled []string) []flow.Rule {
	for i := range rules {
		r := &rules[i]
		if len(r.Kinds) == 0 && slices.Contains(handled, r.Name) {
			r.Kinds = []string{r.Name}
		}
		if len(r.Kinds) == 0 {
			log.Warn("keel worker: a --concurrency-limit or --rate-limit names no kind this worker handles: it limits nothing here "+
				"(check the kind's name; a resource handlers take needs a flow controller of the program's own, flow.New)",
				"name", r.Name, "kinds", handled)
		}
	}
	return rules
}

// rules turns the flags into flow rules; nil when none are set.
func (l *limitFlags) rules(app App) ([]flow.Rule, error) {
	byName := map[string]*flow.Rule{}
	var order []string
	rule := func(name string) *flow.Rule {
		r, ok := byName[name]
		if !ok {
			r = &flow.Rule{Name: name}
			// A kind's name limits that kind; any other name is a resource
			// that handlers apply with Take/Acquire.
			if app.Kinds.Known(name) {
				r.Kinds = []string{name}
			}
			byName[name] = r
			order = append(order, name)
		}
		return r
	}
	for _, s := range l.concurrency {
		name, n, ok := strings.Cut(strings.TrimSpace(s), "=")
		v, err := strconv.Atoi(n)
		if !ok || name == "" || err != nil || v < 1 {
			return nil, usageError{fmt.Errorf("--concurrency-limit %q: want KIND=N with N ≥ 1", s)}
		}
		rule(name).Concurrency = v
	}
	for _, s := range l.rates {
		name, spec, ok := strings.Cut(strings.TrimSpace(s), "=")
		if !ok || name == "" {
			return nil, usageError{fmt.Errorf("--rate-limit %q: want NAME=RATE/PERIOD[:BURST]", s)}
		}
		spec, burstS, hasBurst := strings.Cut(spec, ":")
		rateS, periodS, ok := strings.Cut(spec, "/")
		rate, err1 := strconv.Atoi(rateS)
		period, err2 := time.ParseDuration(periodS)
		if !ok || err1 != nil || err2 != nil || rate < 1 || period <= 0 {
			return nil, usageError{fmt.Errorf("--rate-limit %q: want KIND=RATE/PERIOD[:BURST], e.g. mail:send=50/1s", s)}
		}
		r := rule(name)
		r.Rate, r.Period = rate, period
		if hasBurst {
			b, err := strconv.Atoi(burstS)
			if err != nil || b < 1 {
				return nil, usageError{fmt.Errorf("--rate-limit %q: burst must be a whole number ≥ 1", s)}
			}
			r.Burst = b
		}
	}
	rules := make([]flow.Rule, 0, len(order))
	for _, name := range order {
		rules = append(rules, *byName[name])
	}
	return rules, nil
}
