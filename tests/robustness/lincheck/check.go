package main

import (
	"math"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/anishathalye/porcupine"
)

// A partition is one key group's ops and what checking them found.
type partition struct {
	g      *group
	ops    []porcupine.Operation
	result porcupine.CheckResult
}

// A violation explains an illegal partition: the longest linearizable
// prefix the search found, the state after it, and the ops that could have
// come next, none of which leads to a linearization.
type violation struct {
	p      *partition
	prefix []porcupine.Operation
	state  *kv
	next   []porcupine.Operation
}

// toPartitions makes porcupine's operations, one partition per key group.
// An op of unknown outcome returns after every other op: it may take
// effect at any time after its call, or never.
func toPartitions(h *history) []*partition {
	var last int64 = math.MinInt64
	for _, o := range h.ops {
		if o.call > last {
			last = o.call
		}
		if !o.unknown && o.ret > last {
			last = o.ret
		}
	}
	forever := last
	if forever < math.MaxInt64 {
		forever++
	}
	parts := make([]*partition, len(h.groups))
	byGroup := make(map[*group]*partition, len(h.groups))
	for i, g := range h.groups {
		parts[i] = &partition{g: g}
		byGroup[g] = parts[i]
	}
	for _, o := range h.ops {
		ret := o.ret
		if o.unknown {
			ret = forever
		}
		var out interface{}
		if o.out != nil {
			out = o.out
		}
		p := byGroup[o.g]
		p.ops = append(p.ops, porcupine.Operation{
			ClientId: o.index, Input: o, Call: o.call, Output: out, Return: ret, Metadata: o,
		})
	}
	return parts
}

// checkAll checks the partitions on as many goroutines as workers, the
// largest first, until the deadline (none when zero) or until g trips. A
// partition not started by then, or not finished, is porcupine.Unknown.
func checkAll(parts []*partition, deadline time.Time, workers int, g *guard) {
	order := append([]*partition(nil), parts...)
	sort.SliceStable(order, func(i, j int) bool { return len(order[i].ops) > len(order[j].ops) })
	model := newModel(false, g)
	jobs := make(chan *partition)
	var wg sync.WaitGroup
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for p := range jobs {
				pruned := withoutUnobserved(p.ops)
				p.result = checkOne(model, pruned, deadline, g)
				if p.result != porcupine.Ok && len(pruned) < len(p.ops) {
					p.result = checkOne(model, p.ops, deadline, g)
				}
			}
		}()
	}
	for _, p := range order {
		jobs <- p
	}
	close(jobs)
	wg.Wait()
}

// withoutUnobserved drops the writes of unknown outcome that left no trace
// an answered op could have seen: a set, multi_set, compare_set or append
// whose values appear in no result and in no answered compare_set's
// expected value. Never applying such a write is one of the outcomes its
// unknown status allows, so a history linearizable without it is
// linearizable with it; and each of these ops, kept, is a pending op the
// search must try at every step after its call, which is what makes long
// faulty histories blow up. The converse does not hold (an unseen set may
// be what a later delete found, or what a later add failed on), so a
// partition that is not linearizable without them is checked again whole.
func withoutUnobserved(ops []porcupine.Operation) []porcupine.Operation {
	var seen strings.Builder
	for _, o := range ops {
		in := o.Input.(*op)
		if in.unknown {
			continue
		}
		if in.kind == opCas {
			seen.WriteString(in.vals[0])
			seen.WriteByte(0)
		}
		if in.out == nil {
			continue
		}
		seen.WriteString(in.out.str)
		seen.WriteByte(0)
		for _, v := range in.out.list {
			seen.WriteString(v)
			seen.WriteByte(0)
		}
	}
	text := seen.String()
	kept := make([]porcupine.Operation, 0, len(ops))
	for _, o := range ops {
		in := o.Input.(*op)
		if in.unknown && leavesValues(in.kind) {
			observed := false
			for i, v := range in.vals {
				if in.kind == opCas && i == 0 {
					continue // expected: not written
				}
				if v == "" || strings.Contains(text, v) {
					observed = true
					break
				}
			}
			if !observed {
				continue
			}
		}
		kept = append(kept, o)
	}
	return kept
}

// leavesValues: the kinds whose every effect carries one of their values.
func leavesValues(k opKind) bool {
	return k == opSet || k == opMultiSet || k == opCas || k == opAppend
}

func checkOne(model porcupine.Model, ops []porcupine.Operation, deadline time.Time, g *guard) porcupine.CheckResult {
	if g.tripped.Load() {
		return porcupine.Unknown
	}
	var result porcupine.CheckResult
	if deadline.IsZero() {
		result = porcupine.Illegal
		if porcupine.CheckOperations(model, ops) {
			result = porcupine.Ok
		}
	} else {
		left := time.Until(deadline)
		if left <= 0 {
			return porcupine.Unknown
		}
		result = porcupine.CheckOperationsTimeout(model, ops, left)
	}
	// Once the guard trips every step fails, so a search that was still
	// going ends as if the partition were illegal.
	if g.tripped.Load() {
		return porcupine.Unknown
	}
	return result
}

// explain checks the illegal partitions again, keeping what porcupine
// records of the search (which makes it slower, so the first pass does
// without), and returns a violation for each, in order, and porcupine's
// record for its visualization. The timeout (zero: none) and the memory
// limit (zero: none) may cut the search short: cut says which ("time",
// "memory" or ""); what the search found by then still explains.
func explain(illegal []*partition, timeout time.Duration, limit uint64) (vs []violation, info porcupine.LinearizationInfo, cut string) {
	var all []porcupine.Operation
	for _, p := range illegal {
		all = append(all, p.ops...)
	}
	g := startGuard(limit)
	// newModel(true, ...) partitions by group in order of first
	// appearance, which is the order of illegal.
	result, info := porcupine.CheckOperationsVerbose(newModel(true, g), all, timeout)
	g.stop()
	switch {
	case g.tripped.Load():
		cut = "memory"
	case result == porcupine.Unknown:
		cut = "time"
	}
	partials := info.PartialLinearizations()
	vs = make([]violation, len(illegal))
	for i, p := range illegal {
		v := violation{p: p, state: emptyKV}
		var best []int
		if i < len(partials) {
			best = longest(partials[i])
		}
		done := make([]bool, len(p.ops))
		for _, id := range best {
			o := p.ops[id]
			_, next := step(v.state, o.Input, o.Output)
			v.state = next.(*kv)
			v.prefix = append(v.prefix, o)
			done[id] = true
		}
		// What could come next: the ops left that are called before any
		// of those left returns.
		var firstReturn int64 = math.MaxInt64
		for id, o := range p.ops {
			if !done[id] && o.Return < firstReturn {
				firstReturn = o.Return
			}
		}
		for id, o := range p.ops {
			if !done[id] && o.Call <= firstReturn {
				v.next = append(v.next, o)
			}
		}
		sort.SliceStable(v.next, func(a, b int) bool { return v.next[a].Call < v.next[b].Call })
		vs[i] = v
	}
	return vs, info, cut
}

// longest is the longest sequence, the first in order of ids among equals.
func longest(seqs [][]int) []int {
	var best []int
	for _, s := range seqs {
		if len(s) > len(best) || (len(s) == len(best) && lessInts(s, best)) {
			best = s
		}
	}
	return best
}

func lessInts(a, b []int) bool {
	for i := range a {
		if a[i] != b[i] {
			return a[i] < b[i]
		}
	}
	return false
}
