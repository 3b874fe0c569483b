// Command lincheck checks that histories of operations on a c10d store
// (cohortd's) are linearizable, with porcupine. README.md describes the
// history format, the output and the exit codes.
package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"time"

	"github.com/anishathalye/porcupine"
)

const (
	exitLinearizable = 0
	exitIllegal      = 1
	exitTimeout      = 2
	exitBadInput     = 3
)

const usage = `usage: lincheck [--timeout=60s] [--max_memory_mb=4096] [--html=DIR] [--json] FILE...

Checks that the operations in FILEs (JSON Lines, tests/robustness/lincheck/README.md)
are linearizable. Exit status: 0 linearizable, 1 not linearizable, 2 the check
gave up at the timeout or the memory limit (no verdict), 3 bad input.
`

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

func run(args []string, stdout, stderr io.Writer) int {
	flags := flag.NewFlagSet("lincheck", flag.ContinueOnError)
	flags.SetOutput(stderr)
	flags.Usage = func() {
		fmt.Fprint(stderr, usage)
		flags.PrintDefaults()
	}
	timeout := flags.Duration("timeout", 60*time.Second, "give up checking after this long (exit 2); 0: never")
	htmlDir := flags.String("html", "", "when not linearizable, write porcupine's visualization to `DIR`/lincheck.html")
	asJSON := flags.Bool("json", false, "print the summary as one JSON object")
	maxMemory := flags.Uint64("max_memory_mb", 4096, "give up checking (exit 2) once the heap passes this many MiB; 0: never")
	// Flags may come after files too: parse again after each file.
	var files []string
	for rest := args; ; {
		if err := flags.Parse(rest); err != nil {
			if errors.Is(err, flag.ErrHelp) {
				return exitLinearizable
			}
			return exitBadInput
		}
		if flags.NArg() == 0 {
			break
		}
		files = append(files, flags.Arg(0))
		rest = flags.Args()[1:]
	}
	if len(files) == 0 || *timeout < 0 {
		flags.Usage()
		return exitBadInput
	}

	h, err := readHistory(files)
	if err != nil {
		fmt.Fprintf(stderr, "lincheck: bad input: %v\n", err)
		return exitBadInput
	}
	start := time.Now()
	var deadline time.Time
	if *timeout > 0 {
		deadline = start.Add(*timeout)
	}
	limit := *maxMemory << 20
	parts := toPartitions(h)
	g := startGuard(limit)
	checkAll(parts, deadline, runtime.GOMAXPROCS(0), g)
	g.stop()
	s := summarize(h, parts, time.Since(start))
	if len(s.unfinished) > 0 {
		s.GaveUp = "time"
		if g.tripped.Load() {
			s.GaveUp = "memory"
		}
	}

	// Details go where they do not spoil the JSON.
	details := stdout
	if *asJSON {
		details = stderr
	}
	var violations []violation
	var cut string
	if len(s.illegal) > 0 {
		var info porcupine.LinearizationInfo
		violations, info, cut = explain(s.illegal, *timeout, limit)
		if *htmlDir != "" {
			path := filepath.Join(*htmlDir, "lincheck.html")
			err := os.MkdirAll(*htmlDir, 0o755)
			if err == nil {
				err = porcupine.VisualizePath(newModel(true, nil), info, path)
			}
			if err != nil {
				fmt.Fprintf(stderr, "lincheck: writing the visualization: %v\n", err)
			} else {
				s.HTML = path
			}
		}
	}
	if *asJSON {
		s.printJSON(stdout)
	} else {
		s.print(stdout, *timeout, *maxMemory)
	}
	for _, v := range violations {
		printViolation(details, h, v)
	}
	switch cut {
	case "time":
		fmt.Fprintf(details, "\nlincheck: the search for these explanations timed out (--timeout=%s): a longer prefix may exist\n", *timeout)
	case "memory":
		fmt.Fprintf(details, "\nlincheck: the search for these explanations reached the memory limit (--max_memory_mb=%d): a longer prefix may exist\n", *maxMemory)
	}
	if s.HTML != "" {
		fmt.Fprintf(details, "lincheck: the visualization is in %s\n", s.HTML)
	}
	switch {
	case len(s.illegal) > 0:
		return exitIllegal
	case len(s.unfinished) > 0:
		return exitTimeout
	}
	return exitLinearizable
}
