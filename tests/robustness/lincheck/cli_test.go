package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func runCLI(args ...string) (code int, stdout, stderr string) {
	var out, errs bytes.Buffer
	code = run(args, &out, &errs)
	return code, out.String(), errs.String()
}

func TestLinearizableFilesExitZero(t *testing.T) {
	dir := t.TempDir()
	// One client's ops split over two files, as when a generator restarts.
	a := writeFile(t, dir, "a.jsonl", jsonl(t, []tOp{
		set(1, 1000, 2000, "g0/a", "x"),
		add(2, 1000, 2000, "g1/n", "2", 2),
		get(3, 1000, 2000, "g0/b", "").failed(),
	}))
	b := writeFile(t, dir, "b.jsonl", jsonl(t, []tOp{
		get(1, 3000, 4000, "g0/a", "x"),
		add(2, 3000, 4000, "g1/n", "1", 3).unknown(),
	}))
	code, out, errs := runCLI(a, b)
	if code != exitLinearizable {
		t.Fatalf("exit %d, want 0; stdout:\n%s\nstderr:\n%s", code, out, errs)
	}
	want := "lincheck: 4 operations (1 unknown, 1 dropped) in 2 partitions from 2 files, 3 clients: linearizable"
	if !strings.HasPrefix(out, want) {
		t.Errorf("stdout:\n%s\nwant it to start with:\n%s", out, want)
	}
	if !strings.Contains(out, "lincheck: by op: set 1, get 1, add 2\n") {
		t.Errorf("stdout lacks the counts by op:\n%s", out)
	}
}

func TestIllegalFileExitOneAndExplains(t *testing.T) {
	dir := t.TempDir()
	path := writeFile(t, dir, "h.jsonl", jsonl(t, []tOp{
		set(1, 1_000_000, 2_000_000, "g7/a", "old"),
		set(1, 3_000_000, 4_000_000, "g7/a", "new"),
		get(2, 5_000_000, 6_000_000, "g7/a", "old"),
		set(3, 1_000_000, 2_000_000, "g8/a", "fine"),
	}))
	html := filepath.Join(dir, "viz")
	code, out, errs := runCLI("--html="+html, path)
	if code != exitIllegal {
		t.Fatalf("exit %d, want 1; stdout:\n%s\nstderr:\n%s", code, out, errs)
	}
	for _, want := range []string{
		"NOT linearizable: 1 of 2 partitions illegal (group g7)",
		"group g7 is not linearizable (3 operations)",
		`client 1, 2.000..3.000 ms: set g7/a "new"  (` + path + ":2)",
		"State then: {g7/a=\"new\"}",
		`client 2, 4.000..5.000 ms: get g7/a -> "old"  (` + path + `:3): the store would return "new"`,
		"the visualization is in " + filepath.Join(html, "lincheck.html"),
	} {
		if !strings.Contains(out, want) {
			t.Errorf("stdout lacks %q:\n%s", want, out)
		}
	}
	page, err := os.ReadFile(filepath.Join(html, "lincheck.html"))
	if err != nil || !bytes.Contains(page, []byte(`get g7/a -\u003e \"old\"`)) {
		t.Errorf("visualization: %v; it shows the get: %v", err, bytes.Contains(page, []byte("g7/a")))
	}
}

func TestJSONSummary(t *testing.T) {
	dir := t.TempDir()
	path := writeFile(t, dir, "h.jsonl", jsonl(t, []tOp{
		set(1, 0, 10, "g/a", "1"),
		check(2, 20, 30, false, "g/a"),
		set(1, 20, 30, "h/a", "1").unknown(),
		get(3, 20, 30, "h/a", "1").unknown(),
	}))
	code, out, errs := runCLI("--json", path)
	if code != exitIllegal {
		t.Fatalf("exit %d, want 1; stderr:\n%s", code, errs)
	}
	var got map[string]interface{}
	if err := json.Unmarshal([]byte(out), &got); err != nil {
		t.Fatalf("stdout is not one JSON object: %v\n%s", err, out)
	}
	want := map[string]interface{}{
		"operations": 3.0, "unknown": 1.0, "dropped": 1.0, "partitions": 2.0, "files": 1.0, "clients": 3.0,
		"result": "illegal", "violations": 1.0,
		"by_op":          map[string]interface{}{"set": 2.0, "check": 1.0},
		"illegal_groups": []interface{}{"g"}, "unfinished_groups": []interface{}{},
	}
	for k, v := range want {
		if fmt.Sprint(got[k]) != fmt.Sprint(v) {
			t.Errorf("%s: %v, want %v", k, got[k], v)
		}
	}
	if !strings.Contains(errs, "group g is not linearizable") {
		t.Errorf("the explanation is not on stderr:\n%s", errs)
	}
}

// Every client writes its own value at once, and a later read sees none of
// them: refuting that means trying every order of the writes, far more
// than any machine does in the timeout. The verdict is "unknown", never a
// pass.
func TestTimeoutIsNotAPass(t *testing.T) {
	var ops []tOp
	const writers = 26
	for c := int64(0); c < writers; c++ {
		ops = append(ops, set(c, 0, 100, "g/a", fmt.Sprint("v", c)))
	}
	ops = append(ops, get(writers, 200, 300, "g/a", "none of them"))
	path := writeFile(t, t.TempDir(), "h.jsonl", jsonl(t, ops))
	code, out, errs := runCLI("--timeout=100ms", path)
	if code != exitTimeout {
		t.Fatalf("exit %d, want 2; stdout:\n%s\nstderr:\n%s", code, out, errs)
	}
	if !strings.Contains(out, "UNKNOWN, not a pass: the check gave up at the timeout (100ms) with 1 of 1 partition unfinished (group g)") {
		t.Errorf("stdout:\n%s", out)
	}
	code, out, _ = runCLI("--timeout=100ms", "--json", path)
	if code != exitTimeout || !strings.Contains(out, `"result":"timeout"`) ||
		!strings.Contains(out, `"unfinished_groups":["g"],"gave_up":"time"`) {
		t.Errorf("exit %d, stdout %s", code, out)
	}
	// With no timeout, the memory limit stops the same search.
	code, out, _ = runCLI("--timeout=0", "--max_memory_mb=32", "--json", path)
	if code != exitTimeout || !strings.Contains(out, `"gave_up":"memory"`) {
		t.Errorf("exit %d, stdout %s", code, out)
	}
	code, out, _ = runCLI("--timeout=0", "--max_memory_mb=32", path)
	if code != exitTimeout || !strings.Contains(out, "gave up at the memory limit (32 MiB)") {
		t.Errorf("exit %d, stdout %s", code, out)
	}
}

func TestPassedDeadlineLeavesPartitionsUnfinished(t *testing.T) {
	r := newReader()
	if err := r.read("h", bytes.NewReader(jsonl(t, []tOp{set(1, 0, 10, "g/a", "1"), set(2, 0, 10, "h/a", "1")}))); err != nil {
		t.Fatal(err)
	}
	h, err := r.finish()
	if err != nil {
		t.Fatal(err)
	}
	parts := toPartitions(h)
	checkAll(parts, time.Now().Add(-time.Second), 2, startGuard(0))
	if s := summarize(h, parts, 0); s.Result != "timeout" || len(s.UnfinishedGroups) != 2 {
		t.Errorf("result %q, unfinished %v", s.Result, s.UnfinishedGroups)
	}
}

func TestBadInputExitsThree(t *testing.T) {
	good := `{"client":1,"op":"set","keys":["g/a"],"values":["x"],"call":0,"return":10,"status":"ok"}`
	cases := []struct{ line, want string }{
		{`{"client":1,`, "h.jsonl:2: bad JSON"},
		{`[1,2]`, "bad JSON"},
		{`{"client":"one","op":"set","keys":["g/a"],"values":["x"],"call":20,"return":30,"status":"ok"}`, "cannot unmarshal string"},
		{`{"op":"set","keys":["g/a"],"values":["x"],"call":20,"return":30,"status":"ok"}`, "no client"},
		{`{"client":2,"keys":["g/a"],"call":20,"return":30,"status":"ok"}`, "no op"},
		{`{"client":2,"op":"set","keys":["g/a"],"values":["x"],"return":30,"status":"ok"}`, "no call time"},
		{`{"client":2,"op":"set","keys":["g/a"],"values":["x"],"call":20,"return":30}`, "no status"},
		{`{"client":2,"op":"set","keys":["g/a"],"values":["x"],"call":20,"status":"ok"}`, "status ok needs a return time"},
		{`{"client":2,"op":"set","keys":["g/a"],"values":["x"],"call":20,"return":30,"status":"maybe"}`, `unknown status "maybe"`},
		{`{"client":2,"op":"frobnicate","keys":["g/a"],"call":20,"return":30,"status":"ok"}`, `unknown op "frobnicate"`},
		{`{"client":2,"op":"set","keys":["g/a","g/b"],"values":["x"],"call":20,"return":30,"status":"ok"}`,
			"set takes 1 key and 1 value, got 2 keys and 1 value"},
		{`{"client":2,"op":"cas","keys":["g/a"],"values":["x"],"call":20,"return":30,"status":"ok","out":"x"}`,
			"cas takes 1 key and 2 values, got 1 key and 1 value"},
		{`{"client":2,"op":"check","keys":[],"call":20,"return":30,"status":"ok","out":true}`,
			"check takes one or more keys and no values, got 0 keys and 0 values"},
		{`{"client":2,"op":"multi_set","keys":["g/a","g/b"],"values":["1"],"call":20,"return":30,"status":"ok"}`,
			"multi_set takes one or more keys and as many values, got 2 keys and 1 value"},
		{`{"client":2,"op":"get","keys":["g/a"],"call":20,"return":30,"status":"ok"}`, "get with status ok needs out (a string)"},
		{`{"client":2,"op":"check","keys":["g/a"],"call":20,"return":30,"status":"ok","out":"yes"}`, `check's out "yes" is not a bool`},
		{`{"client":2,"op":"add","keys":["g/n"],"values":["1"],"call":20,"return":30,"status":"ok","out":1.5}`, "add's out 1.5 is not an int64"},
		{`{"client":2,"op":"add","keys":["g/n"],"values":["one"],"call":20,"return":30,"status":"ok","out":1}`, `add's value "one" is not a decimal int64`},
		{`{"client":2,"op":"multi_get","keys":["g/a","g/b"],"call":20,"return":30,"status":"ok","out":["1"]}`,
			"multi_get's out [\"1\"] is not a list of 2 strings"},
		{`{"client":2,"op":"get","keys":["a"],"call":20,"return":30,"status":"ok","out":"x"}`, `key "a" has no group`},
		{`{"client":2,"op":"wait","keys":["g/a","h/b"],"call":20,"return":30,"status":"ok"}`, `keys "g/a" and "h/b" are of different groups`},
		{`{"client":2,"op":"set","keys":["g/a"],"values":["x"],"call":30,"return":20,"status":"ok"}`, "returns (20) before its call (30)"},
		{`{"client":1,"op":"set","keys":["g/b"],"values":["x"],"call":5,"return":20,"status":"fail"}`,
			"client 1 has two operations at once: h.jsonl:1 [0, 10] and h.jsonl:2 [5, 20]"},
	}
	dir := t.TempDir()
	for _, c := range cases {
		path := writeFile(t, dir, "h.jsonl", []byte(good+"\n"+c.line+"\n"))
		code, out, errs := runCLI(path)
		errs = strings.ReplaceAll(errs, dir+string(filepath.Separator), "")
		if code != exitBadInput || out != "" || !strings.Contains(errs, c.want) {
			t.Errorf("line %s: exit %d, stdout %q, stderr %q; want exit 3 and %q", c.line, code, out, errs, c.want)
		}
	}
}

func TestBadInvocationExitsThree(t *testing.T) {
	path := writeFile(t, t.TempDir(), "h.jsonl", jsonl(t, []tOp{set(1, 0, 10, "g/a", "1")}))
	for _, args := range [][]string{
		{},
		{"--frobnicate", path},
		{"--timeout=-1s", path},
		{filepath.Join(t.TempDir(), "missing.jsonl")},
	} {
		if code, _, _ := runCLI(args...); code != exitBadInput {
			t.Errorf("lincheck %q: exit %d, want 3", args, code)
		}
	}
	if code, out, _ := runCLI(path, "--json"); code != exitLinearizable || !strings.HasPrefix(out, "{") {
		t.Errorf("a flag after the file: exit %d, stdout %q", code, out)
	}
}
