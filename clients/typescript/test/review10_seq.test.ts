// Review 10: the client's report numbering against idem's.
//
// Promise (clients/typescript/src/index.ts, Step.report: "A report is
// numbered once idem answered it"; jobs/hub.go checkReport and the commit
// of 1e95df0: a sleep past half the retention, or an await of no valid
// event name, "is refused and changes nothing"). idem does not number a
// refused report, but the client takes its number: the step's next report
// skips one and is refused too ("seq 2 follows 0"). A step that handles the
// refusal can never report done: its attempt ends as a dead worker's.
import assert from "node:assert/strict";
import { randomBytes } from "node:crypto";
import { after, before, test } from "node:test";

import { Client, ProblemError, Worker } from "../src/index.js";
import { Idem } from "./helpers.js";

let idem: Idem;
before(async () => {
  idem = await Idem.start();
});
after(async () => {
  await idem.stop();
});

test("a step that handles a refused await still finishes", async () => {
  const c = new Client(idem.url);
  const kind = "fallback-" + randomBytes(4).toString("hex");
  await c.declareKind(kind, [{ name: "a" }], { task_timeout: "2s", backoff: "100ms" });
  const refused: number[] = [];
  const w = new Worker(c, [kind], {
    a: async (s) => {
      try {
        await s.awaitEvent("not a valid event name!"); // refused: no valid event name
      } catch (e) {
        if (!(e instanceof ProblemError)) throw e;
        refused.push(e.status);
      }
      return "fell back";
    },
  }, { waitMs: 2000 });
  const running = w.run();
  try {
    await c.submitJob(kind + "-1", kind);
    const j = await c.waitJob(kind + "-1", 15_000);
    assert.equal(refused[0], 400);
    assert.equal(j.state, "succeeded", `the done after a refused await was refused too: ${JSON.stringify(j)}`);
  } finally {
    w.stop();
    await running;
  }
});
