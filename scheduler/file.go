package scheduler

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"strings"
	"time"

	"go.yaml.in/yaml/v3"
)

// LoadFile reads a schedule file (format in the package doc) and checks
// every entry except its kind, which only a scheduler knows. Errors name the
// file, line, entry and field.
func LoadFile(path string) ([]Entry, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("schedule file: %w", err)
	}
	return ParseFile(path, data)
}

// ParseFile reads a schedule from data (for a schedule embedded in a
// program); name stands for the file in errors.
func ParseFile(name string, data []byte) ([]Entry, error) {
	var doc yaml.Node
	if err := yaml.Unmarshal(data, &doc); err != nil {
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	// An empty file is refused rather than read as "no entries": a reload
	// catching a file half-written in place must not stop every entry.
	if len(doc.Content) == 0 {
		return nil, fmt.Errorf("%s: empty; want a mapping with entries: (an empty schedule is entries: [])", name)
	}
	top := doc.Content[0]
	if top.Kind != yaml.MappingNode {
		return nil, fmt.Errorf("%s:%d: want a mapping with entries:", name, top.Line)
	}
	var list *yaml.Node
	for i := 0; i < len(top.Content); i += 2 {
		k, v := top.Content[i], top.Content[i+1]
		if k.Value != "entries" {
			return nil, fmt.Errorf("%s:%d: unknown key %q (want entries)", name, k.Line, k.Value)
		}
		if list != nil {
			return nil, fmt.Errorf("%s:%d: entries: given twice", name, k.Line)
		}
		list = v
	}
	if list == nil {
		return nil, fmt.Errorf("%s:%d: no entries: key", name, top.Line)
	}
	if list.Kind != yaml.SequenceNode {
		return nil, fmt.Errorf("%s:%d: entries: want a list", name, list.Line)
	}
	entries := make([]Entry, 0, len(list.Content))
	lines := make([]map[string]int, 0, len(list.Content))
	for i, n := range list.Content {
		e, at, err := decodeEntry(n)
		if err != nil {
			return nil, fmt.Errorf("%s:%d: %w", name, err.line, &EntryError{Name: e.Name, Index: i + 1, Field: err.field, Err: err.err})
		}
		entries = append(entries, e)
		lines = append(lines, at)
	}
	if _, err := compileAll(entries, nil); err != nil {
		var ee *EntryError
		if errors.As(err, &ee) {
			at := lines[ee.Index-1]
			line, ok := at[ee.Field]
			if !ok {
				line = at[""]
			}
			return nil, fmt.Errorf("%s:%d: %w", name, line, err)
		}
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	return entries, nil
}

// fields are an entry's keys in the file.
var fields = []string{"name", "spec", "timezone", "kind", "payload", "queue", "max_retry", "timeout"}

type fieldError struct {
	line  int
	field string
	err   error
}

// decodeEntry reads one entry; at maps each field (and "" the entry) to its
// line.
func decodeEntry(n *yaml.Node) (e Entry, at map[string]int, ferr *fieldError) {
	at = map[string]int{"": n.Line}
	if n.Kind != yaml.MappingNode {
		return e, at, &fieldError{n.Line, "", errors.New("want a mapping of name, spec, kind, ...")}
	}
	// The name first, so that errors in the other fields can name the entry.
	for i := 0; i < len(n.Content); i += 2 {
		if k, v := n.Content[i], n.Content[i+1]; k.Value == "name" {
			if v.Kind != yaml.ScalarNode {
				return e, at, &fieldError{v.Line, "name", errors.New("bad name: want a string")}
			}
			e.Name = v.Value
		}
	}
	for i := 0; i < len(n.Content); i += 2 {
		k, v := n.Content[i], n.Content[i+1]
		if _, dup := at[k.Value]; dup {
			return e, at, &fieldError{k.Line, k.Value, fmt.Errorf("%s given twice", k.Value)}
		}
		at[k.Value] = v.Line
		bad := func(format string, args ...any) *fieldError {
			return &fieldError{v.Line, k.Value, fmt.Errorf("bad "+k.Value+": "+format, args...)}
		}
		str := func(dst *string) *fieldError {
			if v.Kind != yaml.ScalarNode {
				return bad("want a string")
			}
			*dst = v.Value
			return nil
		}
		var err *fieldError
		switch k.Value {
		case "name":
		case "spec":
			err = str(&e.Spec)
		case "timezone":
			err = str(&e.TimeZone)
		case "kind":
			err = str(&e.Kind)
		case "queue":
			err = str(&e.Queue)
		case "max_retry":
			var m int
			if v.Kind != yaml.ScalarNode || v.Decode(&m) != nil {
				err = bad("%q is not a whole number", v.Value)
			}
			e.MaxRetry = &m
		case "timeout":
			var s string
			if err = str(&s); err == nil {
				d, perr := time.ParseDuration(s)
				if perr != nil {
					err = bad("%q is not a duration like 30s or 5m", s)
				}
				e.Timeout = d
			}
		case "payload":
			j, perr := nodeJSON(v)
			if perr == nil {
				e.Payload, perr = json.Marshal(j)
			}
			if perr != nil {
				err = bad("%v", perr)
			}
		default:
			err = &fieldError{k.Line, k.Value, fmt.Errorf("unknown field %q (known: %s)", k.Value, strings.Join(fields, ", "))}
		}
		if err != nil {
			return e, at, err
		}
	}
	return e, at, nil
}

// nodeJSON turns a YAML value into one JSON can encode. Scalars that are
// not numbers, booleans or null stay the text written: a date stays
// "2030-01-01", not a timestamp. Mapping keys are taken as written (7: → "7").
func nodeJSON(n *yaml.Node) (any, error) {
	switch n.Kind {
	case yaml.AliasNode:
		return nodeJSON(n.Alias)
	case yaml.MappingNode:
		out := make(map[string]any, len(n.Content)/2)
		for i := 0; i < len(n.Content); i += 2 {
			k, v := n.Content[i], n.Content[i+1]
			if k.Kind != yaml.ScalarNode || k.ShortTag() == "!!merge" {
				return nil, errors.New("a key is a list, mapping or merge; JSON keys are text")
			}
			j, err := nodeJSON(v)
			if err != nil {
				return nil, fmt.Errorf("%s: %w", k.Value, err)
			}
			out[k.Value] = j
		}
		return out, nil
	case yaml.SequenceNode:
		out := make([]any, len(n.Content))
		for i, c := range n.Content {
			j, err := nodeJSON(c)
			if err != nil {
				return nil, fmt.Errorf("[%d]: %w", i, err)
			}
			out[i] = j
		}
		return out, nil
	case yaml.ScalarNode:
		switch n.ShortTag() {
		case "!!null":
			return nil, nil
		case "!!bool", "!!int", "!!float":
			var v any
			if err := n.Decode(&v); err != nil {
				return nil, err
			}
			if f, ok := v.(float64); ok && (math.IsInf(f, 0) || math.IsNaN(f)) {
				return nil, fmt.Errorf("%s has no JSON form", n.Value)
			}
			return v, nil
		}
		return n.Value, nil
	}
	return nil, errors.New("unsupported YAML value")
}
