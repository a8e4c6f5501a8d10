// Idempotent calls through idem's sidecar: one key per operation, retried
// with the same key; a replay recognised; a lost reply retried charges once.
import assert from "node:assert/strict";
import http from "node:http";
import type { AddressInfo } from "node:net";
import { after, before, test } from "node:test";

import { Client, ProblemError } from "../src/index.js";
import { Idem, LossyProxy } from "./helpers.js";

const charges: unknown[] = [];
const upstream = http.createServer((req, res) => {
  const chunks: Buffer[] = [];
  req.on("data", (c) => chunks.push(c));
  req.on("end", () => {
    charges.push(JSON.parse(Buffer.concat(chunks).toString()));
    const out = JSON.stringify({ charge: charges.length });
    res.writeHead(201, { "content-type": "application/json", "content-length": String(out.length) });
    res.end(out);
  });
});
let idem: Idem;
before(async () => {
  await new Promise<void>((r) => upstream.listen(0, "127.0.0.1", r));
  idem = await Idem.start("--upstream", `http://127.0.0.1:${(upstream.address() as AddressInfo).port}`);
});
after(async () => {
  await idem.stop();
  upstream.closeAllConnections();
  upstream.close();
});

test("a lost reply retried charges once", async () => {
  const proxy = await LossyProxy.start(idem.url, ["POST /charges"]);
  try {
    const c = new Client(proxy.url);
    const r = await c.call("POST", "/charges", { json: { amount: 5 } });
    assert.deepEqual(proxy.dropped, ["POST /charges"]);
    assert.equal(r.status, 201);
    assert.ok(r.replayed);
    assert.deepEqual(charges.filter((ch) => JSON.stringify(ch) === '{"amount":5}'), [{ amount: 5 }]);
    const again = await c.call("POST", "/charges", { json: { amount: 5 }, key: r.key });
    assert.ok(again.replayed);
    assert.deepEqual(again.json(), r.json());
  } finally {
    proxy.close();
  }
});

test("a key reused with other parameters is refused", async () => {
  const c = new Client(idem.url);
  const r = await c.call("POST", "/charges", { json: { amount: 7 } });
  assert.ok(!r.replayed);
  await assert.rejects(c.call("POST", "/charges", { json: { amount: 8 }, key: r.key }),
    (e: unknown) => e instanceof ProblemError && e.status === 422 && e.kind === "mismatch");
});
