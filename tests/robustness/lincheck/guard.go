package main

import (
	"runtime/metrics"
	"sync/atomic"
	"time"
)

// A guard bounds the memory porcupine's search takes: its cache keeps a
// copy of the set of linearized ops with every state it reaches, so a
// search that has to exhaust a large partition (one that is not
// linearizable, with many concurrent ops) can fill the machine. Once the
// heap passes the limit, the guard trips: no op can step from then on, so
// the search unwinds at once, and what it concludes is no verdict.
type guard struct {
	limit   uint64 // bytes; 0: none
	tripped atomic.Bool
	done    chan struct{}
}

const heapMetric = "/memory/classes/heap/objects:bytes"

func startGuard(limit uint64) *guard {
	g := &guard{limit: limit, done: make(chan struct{})}
	if limit > 0 {
		go g.watch()
	}
	return g
}

func (g *guard) watch() {
	sample := []metrics.Sample{{Name: heapMetric}}
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-g.done:
			return
		case <-tick.C:
			metrics.Read(sample)
			if sample[0].Value.Uint64() > g.limit {
				g.tripped.Store(true)
				return
			}
		}
	}
}

func (g *guard) stop() { close(g.done) }
