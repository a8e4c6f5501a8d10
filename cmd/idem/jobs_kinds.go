package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"strings"
	"text/tabwriter"

	"github.com/idem-dev/idem/etcdstore"
	"github.com/idem-dev/idem/jobs"
)

// kindsArgs is how many arguments each idem jobs kinds verb takes.
var kindsArgs = map[string]int{"apply": 2, "ls": 1, "get": 2, "delete": 2}

// jobsKinds declares kinds from a file, and lists, shows and removes
// declared kinds: the kinds workers in any language run through
// /v1/work (JOBS.md, "Workers in any language").
func jobsKinds(ctx context.Context, args []string, stdout, stderr io.Writer) (err error) {
	a := newJobsCmd("kinds", "kinds [--tenant T] [--retention D] [-w simple|json|table] apply FILE | ls | get KIND | delete KIND", stderr)
	defer func() { err = a.explain(err) }()
	retention := a.fs.Duration("retention", etcdstore.DefaultRetention, "the retention of the workers' store (idem serve --retention): a declaration is checked against it")
	var decls []jobs.Declaration
	a.check = func() error {
		verb := a.fs.Arg(0)
		n, ok := kindsArgs[verb]
		if !ok {
			a.fs.Usage()
			return fmt.Errorf("idem jobs kinds: %q is not apply, ls, get or delete", verb)
		}
		if a.fs.NArg() != n {
			a.fs.Usage()
			return fmt.Errorf("idem jobs kinds %s takes %d argument(s), got %d", verb, n-1, a.fs.NArg()-1)
		}
		if verb != "apply" {
			return nil
		}
		b, err := os.ReadFile(a.fs.Arg(1))
		if err != nil {
			return err
		}
		decls, err = parseDeclarations(b)
		if err != nil {
			return fmt.Errorf("%s: %w", a.fs.Arg(1), err)
		}
		for _, d := range decls {
			if err := d.Check(*retention); err != nil {
				return fmt.Errorf("%s: %w", a.fs.Arg(1), err)
			}
		}
		return nil
	}
	c, ctx, done, err := a.openJobs(ctx, args, -1)
	if err != nil {
		return err
	}
	defer done()
	q, closeQueue, err := a.queue(ctx, c, *retention)
	if err != nil {
		return err
	}
	defer closeQueue()
	switch verb := a.fs.Arg(0); verb {
	case "apply":
		for _, d := range decls {
			if err := q.Declare(ctx, d); err != nil {
				return err
			}
			fmt.Fprintf(stdout, "kind %s declared (%d steps)\n", d.Name, len(d.Steps))
		}
		return nil
	case "delete":
		ok, err := q.Undeclare(ctx, a.fs.Arg(1))
		if err != nil {
			return err
		}
		if !ok {
			return fmt.Errorf("%w: %s is not declared in tenant %s", jobs.ErrUnknownKind, a.fs.Arg(1), a.tenant)
		}
		fmt.Fprintf(stdout, "kind %s removed\n", a.fs.Arg(1))
		return nil
	}
	ds, err := q.Declared(ctx)
	if err != nil {
		return err
	}
	if a.fs.Arg(0) == "get" {
		var found []jobs.Declaration
		for _, d := range ds {
			if d.Name == a.fs.Arg(1) {
				found = append(found, d)
			}
		}
		if len(found) == 0 {
			return fmt.Errorf("%w: %s is not declared in tenant %s", jobs.ErrUnknownKind, a.fs.Arg(1), a.tenant)
		}
		ds = found
	}
	return printDeclarations(stdout, a.format, ds)
}

// parseDeclarations reads a file of one declaration (a JSON object) or
// many (an array), each checked as PUT /v1/kinds checks it.
func parseDeclarations(b []byte) ([]jobs.Declaration, error) {
	b = bytes.TrimSpace(b)
	var raws []json.RawMessage
	if len(b) > 0 && b[0] == '[' {
		if err := json.Unmarshal(b, &raws); err != nil {
			return nil, fmt.Errorf("not a JSON array of kind declarations: %w", err)
		}
	} else {
		raws = []json.RawMessage{b}
	}
	if len(raws) == 0 {
		return nil, fmt.Errorf("no kind declared")
	}
	var out []jobs.Declaration
	seen := map[string]bool{}
	for i, r := range raws {
		d, err := jobs.ParseDeclaration(r)
		if err != nil {
			return nil, fmt.Errorf("declaration %d: %w", i+1, err)
		}
		if seen[d.Name] {
			return nil, fmt.Errorf("declaration %d: kind %s is declared twice", i+1, d.Name)
		}
		seen[d.Name] = true
		out = append(out, d)
	}
	return out, nil
}

func printDeclarations(w io.Writer, format string, ds []jobs.Declaration) error {
	switch format {
	case "json":
		if ds == nil {
			ds = []jobs.Declaration{}
		}
		return json.NewEncoder(w).Encode(ds)
	case "table":
		tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "KIND\tSTEPS\tMAX ATTEMPTS\tTASK TIMEOUT\tLIMITS")
		for _, d := range ds {
			fmt.Fprintf(tw, "%s\t%s\t%d\t%s\t%d\n", d.Name, stepsOf(d), d.MaxAttempts, d.TaskTimeout, len(d.Limits))
		}
		return tw.Flush()
	}
	for _, d := range ds {
		fmt.Fprintf(w, "%s steps=%s", d.Name, stepsOf(d))
		var scs []string
		for _, sc := range d.Schedules {
			scs = append(scs, sc.Name)
		}
		if len(scs) > 0 {
			fmt.Fprintf(w, " schedules=%s", strings.Join(scs, ","))
		}
		fmt.Fprintln(w)
	}
	return nil
}

// stepsOf names d's steps in order, with what idem runs itself.
func stepsOf(d jobs.Declaration) string {
	var s []string
	for _, st := range d.Steps {
		switch {
		case st.Sleep != "":
			s = append(s, st.Name+"(sleep "+st.Sleep+")")
		case st.Await != "":
			s = append(s, st.Name+"(await "+st.Await+")")
		default:
			s = append(s, st.Name)
		}
	}
	return strings.Join(s, ",")
}
