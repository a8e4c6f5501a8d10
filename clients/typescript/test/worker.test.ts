// A TypeScript worker runs a job through idem's job-worker protocol, to its
// end, under lost replies and a killed worker: each step's effect once.
import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { randomBytes } from "node:crypto";
import { after, before, test } from "node:test";
import { fileURLToPath } from "node:url";

import { Client, ProblemError, Worker } from "../src/index.js";
import { Idem, LossyProxy, Sink } from "./helpers.js";
import { steps } from "./order_worker.js";

let idem: Idem;
before(async () => {
  idem = await Idem.start();
});
after(async () => {
  await idem.stop();
});

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

async function waitState(c: Client, job: string, state: string, timeoutMs = 60_000) {
  const end = Date.now() + timeoutMs;
  for (;;) {
    const j = await c.getJob(job);
    if (j.state === state || Date.now() > end) return j;
    await sleep(50);
  }
}

test("a job survives lost replies and a killed worker", async () => {
  const drops = ["POST /v1/jobs", "POST /v1/work/next", "/sleep", "/await", "/done", "/signals/"];
  const proxy = await LossyProxy.start(idem.url, drops);
  const sink = await Sink.start();
  try {
    const c = new Client(proxy.url);
    const kind = "order-" + randomBytes(4).toString("hex");
    await c.declareKind(kind, [{ name: "charge" }, { name: "approve" }, { name: "cool", sleep: "300ms" }, { name: "ship" }],
      { task_timeout: "2s", backoff: "100ms" });
    const job = kind + "-1";
    await c.submitJob(job, kind, { amount: 12 });
    const first = spawn(process.execPath, [fileURLToPath(new URL("./order_worker.js", import.meta.url)), "run"], {
      env: { ...process.env, IDEM_URL: proxy.url, SINK_URL: sink.url, KIND: kind, BLOCK_IN: "ship" }, stdio: "inherit" });
    const exited = new Promise((r) => first.once("exit", r));
    try {
      assert.equal((await waitState(c, job, "waiting")).awaiting, "approved");
      await c.signalJob(job, "approved", { by: "ana" });
      let timer: NodeJS.Timeout | undefined;
      await Promise.race([sink.entered, new Promise((_, reject) => {
        timer = setTimeout(() => reject(new Error("the first worker never reached ship")), 60_000);
      })]);
      clearTimeout(timer);
    } finally {
      first.kill("SIGKILL");
      await exited;
    }
    const second = new Worker(new Client(proxy.url), [kind], steps(sink.url, ""), { waitMs: 5000 });
    const running = second.run();
    const j = await c.waitJob(job);
    second.stop();
    await running;
    assert.equal(j.state, "succeeded", JSON.stringify(j));
    const outs = Object.fromEntries((j.steps ?? []).map((s) => [s.name, s.output]));
    assert.deepEqual(outs, { charge: { charge: "ch_" + job }, approve: { by: "ana" }, cool: undefined, ship: "shipped" });
    const keys = ["charge", "approve", "ship"].map((s) => `jobs:${job}.${s}`);
    assert.deepEqual(Object.fromEntries(sink.applied), Object.fromEntries(keys.map((k) => [k, 1])));
    const ship = sink.calls.get(keys[2])!;
    assert.ok(ship.length >= 2 && ship[0] < ship[ship.length - 1], `ship ran under tokens ${ship}`);
    assert.deepEqual([...proxy.dropped].sort(), [...drops].sort()); // every kind of reply was lost once
  } finally {
    proxy.close();
    sink.close();
  }
});

test("a step that throws fails as declared", async () => {
  const c = new Client(idem.url);
  const kind = "pay-" + randomBytes(4).toString("hex");
  await c.declareKind(kind, [{ name: "card", on_error: "fail" }], { task_timeout: "5s" });
  const tries: number[] = [];
  const w = new Worker(c, [kind], { card: (s) => { tries.push(s.attempt); throw new Error("card refused"); } }, { waitMs: 5000 });
  const running = w.run();
  await c.submitJob(kind + "-1", kind);
  const j = await c.waitJob(kind + "-1");
  w.stop();
  await running;
  assert.equal(j.state, "failed");
  assert.match(j.error ?? "", /card refused/);
  assert.deepEqual(tries, [1]);
});

test("bad declarations and unknown kinds are refused", async () => {
  const c = new Client(idem.url);
  await assert.rejects(c.declareKind("bad", [{ name: "a", on_error: "later" as "fail" }]),
    (e: unknown) => e instanceof ProblemError && e.status === 400 && e.kind === "invalid-request" && /later/.test(e.message));
  const w = new Worker(c, ["nobody-" + randomBytes(3).toString("hex")], {}, { waitMs: 1000 });
  await assert.rejects(w.next(), (e: unknown) => e instanceof ProblemError && e.status === 404 && e.kind === "unknown-kind");
});
