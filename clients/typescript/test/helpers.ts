// Test fixtures: a real idem serve, a proxy that loses replies, and a sink
// that counts effects. IDEM_BIN names the idem binary (cmd/idem's
// TestClientsTypeScript sets it to its own test binary, with
// IDEM_TEST_RUN_MAIN; by hand: go build -o /tmp/idem ./cmd/idem).
import { spawn, type ChildProcess } from "node:child_process";
import { mkdtempSync } from "node:fs";
import http from "node:http";
import type { AddressInfo } from "node:net";
import { tmpdir } from "node:os";
import path from "node:path";
import readline from "node:readline";

export class Idem {
  url = "";
  logs: string[] = [];
  private proc?: ChildProcess;

  static async start(...args: string[]): Promise<Idem> {
    const bin = process.env.IDEM_BIN;
    if (!bin) throw new Error("set IDEM_BIN to an idem binary (go build -o /tmp/idem ./cmd/idem)");
    const dir = mkdtempSync(path.join(tmpdir(), "idem-ts-"));
    const i = new Idem();
    i.proc = spawn(bin, ["serve", "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0", "--log-format", "json",
      "--data-dir", path.join(dir, "data"), "--embedded-peer-url", "unix://peer.sock", ...args], { cwd: dir, stdio: ["ignore", "ignore", "pipe"] });
    const ready = new Promise<string>((resolve, reject) => {
      const rl = readline.createInterface({ input: i.proc!.stderr! });
      rl.on("line", (line) => {
        i.logs.push(line);
        try {
          const m = JSON.parse(line);
          if (m.msg === "idem listening") resolve("http://" + m.listen);
        } catch { /* not JSON */ }
      });
      i.proc!.on("exit", (code) => reject(new Error(`idem exited (${code}) before listening:\n${i.logs.join("\n")}`)));
      setTimeout(() => reject(new Error("idem did not listen within 90s")), 90_000).unref();
    });
    i.url = await ready;
    return i;
  }

  async stop(): Promise<void> {
    const p = this.proc;
    if (!p || p.exitCode !== null) return;
    const exited = new Promise((r) => p.once("exit", r));
    p.kill("SIGTERM");
    await exited;
  }
}

async function listen(srv: http.Server): Promise<string> {
  await new Promise<void>((r) => srv.listen(0, "127.0.0.1", r));
  return `http://127.0.0.1:${(srv.address() as AddressInfo).port}`;
}

async function readBody(req: http.IncomingMessage): Promise<Buffer> {
  const chunks: Buffer[] = [];
  for await (const c of req) chunks.push(c as Buffer);
  return Buffer.concat(chunks);
}

/** Forwards every request to target and, for the first request of each
 * kind named in drop (a substring of "METHOD path"), reads idem's answer
 * and then closes the connection without passing it on. */
export class LossyProxy {
  url = "";
  dropped: string[] = [];
  private srv: http.Server;
  private pending: string[];

  private constructor(target: string, drop: string[]) {
    this.pending = [...drop];
    const t = new URL(target);
    this.srv = http.createServer(async (req, res) => {
      const body = await readBody(req);
      const headers = { ...req.headers };
      delete headers.host;
      delete headers.connection;
      const up = await new Promise<{ status: number; headers: http.IncomingHttpHeaders; body: Buffer }>((resolve, reject) => {
        const r = http.request({ host: t.hostname, port: t.port, method: req.method, path: req.url, headers, agent: false }, async (resp) => {
          resolve({ status: resp.statusCode!, headers: resp.headers, body: await readBody(resp) });
        });
        r.on("error", reject);
        r.end(body);
      }).catch(() => undefined);
      if (!up) {
        req.socket.destroy();
        return;
      }
      const what = `${req.method} ${req.url}`;
      const rule = up.status < 300 ? this.pending.find((d) => what.includes(d)) : undefined;
      if (rule !== undefined) {
        this.pending.splice(this.pending.indexOf(rule), 1);
        this.dropped.push(rule);
        req.socket.destroy(); // idem answered; the caller never hears it
        return;
      }
      const h = { ...up.headers };
      delete h["transfer-encoding"];
      delete h.connection;
      h["content-length"] = String(up.body.length);
      res.writeHead(up.status, h);
      res.end(up.body);
    });
  }

  static async start(target: string, drop: string[]): Promise<LossyProxy> {
    const p = new LossyProxy(target, drop);
    p.url = await listen(p.srv);
    return p;
  }

  close(): void {
    this.srv.closeAllConnections();
    this.srv.close();
  }
}

/** A downstream that applies each effect once by its idempotency key and
 * refuses a fencing token lower than the highest it saw for the job. */
export class Sink {
  url = "";
  applied = new Map<string, number>();
  calls = new Map<string, bigint[]>();
  highest = new Map<string, bigint>();
  entered: Promise<void>;
  private enter!: () => void;
  private srv: http.Server;

  private constructor() {
    this.entered = new Promise((r) => (this.enter = r));
    this.srv = http.createServer(async (req, res) => {
      const e = JSON.parse((await readBody(req)).toString());
      const token = BigInt(e.token);
      this.calls.set(e.key, [...(this.calls.get(e.key) ?? []), token]);
      let status = 200;
      if (token < (this.highest.get(e.job) ?? 0n)) status = 409;
      else {
        this.highest.set(e.job, token);
        if (!this.applied.has(e.key)) this.applied.set(e.key, 1);
      }
      if (e.enter) this.enter();
      res.writeHead(status, { "content-length": "0" });
      res.end();
    });
  }

  static async start(): Promise<Sink> {
    const s = new Sink();
    s.url = await listen(s.srv);
    return s;
  }

  close(): void {
    this.srv.closeAllConnections();
    this.srv.close();
  }
}
