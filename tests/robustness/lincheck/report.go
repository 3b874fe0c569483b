package main

import (
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/anishathalye/porcupine"
)

// A summary is the outcome of a check; its exported fields are the JSON
// that --json prints.
type summary struct {
	Operations       int            `json:"operations"`
	Unknown          int            `json:"unknown"`
	Dropped          int            `json:"dropped"`
	Partitions       int            `json:"partitions"`
	Files            int            `json:"files"`
	Clients          int            `json:"clients"`
	Result           string         `json:"result"` // "ok", "illegal" or "timeout"
	ByOp             map[string]int `json:"by_op"`
	Violations       int            `json:"violations"`
	IllegalGroups    []string       `json:"illegal_groups"`
	UnfinishedGroups []string       `json:"unfinished_groups"`
	GaveUp           string         `json:"gave_up,omitempty"` // with unfinished groups: "time" or "memory"
	Seconds          float64        `json:"seconds"`
	HTML             string         `json:"html,omitempty"`

	illegal, unfinished []*partition
}

func summarize(h *history, parts []*partition, took time.Duration) *summary {
	s := &summary{
		Operations: len(h.ops), Unknown: h.unknown, Dropped: h.dropped, Partitions: len(parts),
		Files: h.files, Clients: h.clients, ByOp: map[string]int{},
		IllegalGroups: []string{}, UnfinishedGroups: []string{}, Seconds: took.Seconds(),
	}
	for _, o := range h.ops {
		s.ByOp[o.kind.String()]++
	}
	for _, p := range parts {
		switch p.result {
		case porcupine.Illegal:
			s.illegal = append(s.illegal, p)
			s.IllegalGroups = append(s.IllegalGroups, p.g.name)
		case porcupine.Unknown:
			s.unfinished = append(s.unfinished, p)
			s.UnfinishedGroups = append(s.UnfinishedGroups, p.g.name)
		}
	}
	s.Violations = len(s.illegal)
	switch {
	case len(s.illegal) > 0:
		s.Result = "illegal"
	case len(s.unfinished) > 0:
		s.Result = "timeout"
	default:
		s.Result = "ok"
	}
	return s
}

func (s *summary) printJSON(w io.Writer) {
	b, _ := json.Marshal(s)
	fmt.Fprintf(w, "%s\n", b)
}

func (s *summary) print(w io.Writer, timeout time.Duration, maxMemoryMB uint64) {
	limit := fmt.Sprintf("at the timeout (%s)", timeout)
	if s.GaveUp == "memory" {
		limit = fmt.Sprintf("at the memory limit (%d MiB)", maxMemoryMB)
	}
	var verdict string
	switch s.Result {
	case "ok":
		verdict = fmt.Sprintf("linearizable (checked in %.2fs)", s.Seconds)
	case "illegal":
		verdict = fmt.Sprintf("NOT linearizable: %d of %s illegal (%s)",
			len(s.illegal), plural(s.Partitions, "partition"), groupList(s.IllegalGroups))
		if len(s.unfinished) > 0 {
			verdict += fmt.Sprintf("; %d more unfinished %s", len(s.unfinished), limit)
		}
	case "timeout":
		verdict = fmt.Sprintf("UNKNOWN, not a pass: the check gave up %s with %d of %s unfinished (%s)",
			limit, len(s.unfinished), plural(s.Partitions, "partition"), groupList(s.UnfinishedGroups))
	}
	fmt.Fprintf(w, "lincheck: %s (%d unknown, %d dropped) in %s from %s, %s: %s\n",
		plural(s.Operations, "operation"), s.Unknown, s.Dropped, plural(s.Partitions, "partition"),
		plural(s.Files, "file"), plural(s.Clients, "client"), verdict)
	counts := make([]string, 0, numOpKinds)
	for _, name := range opNames {
		if n := s.ByOp[name]; n > 0 {
			counts = append(counts, fmt.Sprintf("%s %d", name, n))
		}
	}
	if len(counts) == 0 {
		counts = append(counts, "none")
	}
	fmt.Fprintf(w, "lincheck: by op: %s\n", strings.Join(counts, ", "))
}

func groupList(names []string) string {
	const max = 10
	if len(names) > max {
		return fmt.Sprintf("groups %s and %d more", strings.Join(names[:max], ", "), len(names)-max)
	}
	if len(names) == 1 {
		return "group " + names[0]
	}
	return "groups " + strings.Join(names, ", ")
}

// opLine shows an op with its client, its times in ms since the history's
// first call, and where it was read.
func opLine(h *history, o porcupine.Operation) string {
	in := o.Input.(*op)
	ms := func(t int64) string { return fmt.Sprintf("%.3f", float64(t-h.start)/1e6) }
	ret := ms(in.ret)
	if in.unknown {
		ret = "?"
	}
	out, _ := o.Output.(*result)
	return fmt.Sprintf("client %d, %s..%s ms: %s  (%s:%d)", in.client, ms(in.call), ret, describeOp(in, out), in.file, in.line)
}

func printViolation(w io.Writer, h *history, v violation) {
	const shown = 6
	fmt.Fprintf(w, "\ngroup %s is not linearizable (%s).\n", v.p.g.name, plural(len(v.p.ops), "operation"))
	if len(v.prefix) == 0 {
		fmt.Fprintf(w, "  No operation can come first.\n")
	} else {
		fmt.Fprintf(w, "  The longest linearizable prefix found has %s; it ends with:\n", plural(len(v.prefix), "operation"))
		from := len(v.prefix) - shown
		if from < 0 {
			from = 0
		}
		for _, o := range v.prefix[from:] {
			fmt.Fprintf(w, "    %s\n", opLine(h, o))
		}
	}
	fmt.Fprintf(w, "  State then: %s\n", describeState(v.state))
	fmt.Fprintf(w, "  None of the operations that could come next leads to a linearization:\n")
	for i, o := range v.next {
		if i == 2*shown {
			fmt.Fprintf(w, "    (and %d more)\n", len(v.next)-i)
			break
		}
		out, _ := o.Output.(*result)
		fmt.Fprintf(w, "    %s: %s\n", opLine(h, o), whyNot(v.state, o.Input.(*op), out))
	}
}
