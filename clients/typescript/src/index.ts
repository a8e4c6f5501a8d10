// idem's client for TypeScript and JavaScript, on Node's fetch alone.
//
// - Client makes idempotent calls through idem's sidecar (one key per
//   operation, retried with the same key), and submits, reads and signals
//   jobs.
// - Worker runs the steps of kinds declared once (Client.declareKind)
//   through idem's job-worker protocol: idem claims each job, counts its
//   attempts, saves each step's output as a recovery point and applies the
//   kind's retries; the worker runs the step's code.

export type Json = null | boolean | number | string | Json[] | { [k: string]: Json };

const problemPrefix = "urn:idem:problem:";
// Problem types a retry with the same key or report can mend (HTTP.md).
const retryableKinds = new Set(["conflict", "unavailable", "store-full", "rate-limited", "upstream-unavailable"]);

/** idem could not be reached, or answered what this client cannot read. */
export class IdemError extends Error {}

/** idem refused a call: `kind` is its problem type after urn:idem:problem:. */
export class ProblemError extends IdemError {
  readonly status: number;
  readonly kind: string;
  readonly problem: Record<string, unknown>;
  constructor(status: number, problem: Record<string, unknown>) {
    const t = String(problem.type ?? "");
    const kind = t.startsWith(problemPrefix) ? t.slice(problemPrefix.length) : t;
    super(`${status} ${kind}: ${String(problem.detail ?? problem.title ?? "")}`);
    this.status = status;
    this.kind = kind;
    this.problem = problem;
  }
}

/** The answer to Client.call; `replayed` when idem answered with the
 * response saved for the first request with this key. */
export interface CallResponse {
  status: number;
  headers: Headers;
  body: Uint8Array;
  key: string;
  replayed: boolean;
  json<T = Json>(): T;
}

interface Answer {
  status: number;
  headers: Headers;
  body: Uint8Array;
}

export interface ClientOptions {
  /** Sent as a bearer token when idem authenticates callers. */
  token?: string;
  /** Bounds each HTTP request (ms, default 70 000). */
  timeoutMs?: number;
  /** Bounds how long a call keeps retrying (ms, default 60 000). */
  retryForMs?: number;
}

const sleep = (ms: number) => new Promise<void>((r) => setTimeout(r, ms));

function randomKey(): string {
  const b = new Uint8Array(16);
  crypto.getRandomValues(b);
  return Buffer.from(b).toString("base64url");
}

function problemKind(a: Answer): string | undefined {
  if (!(a.headers.get("content-type") ?? "").startsWith("application/problem+json")) return undefined;
  try {
    const t = String(JSON.parse(new TextDecoder().decode(a.body)).type ?? "");
    return t.startsWith(problemPrefix) ? t.slice(problemPrefix.length) : t;
  } catch {
    return undefined;
  }
}

function problemOf(a: Answer): ProblemError {
  let p: Record<string, unknown>;
  try {
    p = JSON.parse(new TextDecoder().decode(a.body));
    if (typeof p !== "object" || p === null) throw new Error();
  } catch {
    p = { type: "", detail: new TextDecoder().decode(a.body.slice(0, 200)) };
  }
  return new ProblemError(a.status, p);
}

/** A client of one idem (`base`: its URL, such as http://127.0.0.1:8080). */
export class Client {
  readonly base: string;
  private readonly opts: Required<Omit<ClientOptions, "token">> & { token?: string };

  constructor(base: string, opts: ClientOptions = {}) {
    this.base = base.replace(/\/+$/, "");
    this.opts = { timeoutMs: opts.timeoutMs ?? 70_000, retryForMs: opts.retryForMs ?? 60_000, token: opts.token };
  }

  private async once(method: string, url: string, body: Uint8Array | undefined, headers: Record<string, string>, timeoutMs: number): Promise<Answer> {
    const h: Record<string, string> = { ...headers };
    if (this.opts.token) h["Authorization"] = "Bearer " + this.opts.token;
    const r = await fetch(url, { method, body: body as unknown as BodyInit | undefined, headers: h, signal: AbortSignal.timeout(timeoutMs) });
    return { status: r.status, headers: r.headers, body: new Uint8Array(await r.arrayBuffer()) };
  }

  /** Sends a request until it gets an answer not worth retrying. Every
   * retry is the same request: the caller makes it safe to repeat (an
   * idempotency key, a job id, a report's seq). */
  private async send(method: string, url: string, body: Uint8Array | undefined, headers: Record<string, string>, timeoutMs?: number): Promise<Answer> {
    const deadline = Date.now() + this.opts.retryForMs;
    let delay = 50;
    for (;;) {
      let a: Answer;
      try {
        a = await this.once(method, url, body, headers, timeoutMs ?? this.opts.timeoutMs);
      } catch (e) {
        // The request may or may not have reached idem: the same request
        // again is recognised if it did.
        if (Date.now() + delay > deadline) throw new IdemError(`${method} ${url}: ${String(e)}`);
        await sleep(delay);
        delay = Math.min(delay * 2, 2000);
        continue;
      }
      if ([409, 429, 503].includes(a.status) && retryableKinds.has(problemKind(a) ?? "")) {
        const ra = Number(a.headers.get("retry-after"));
        const wait = Number.isFinite(ra) && ra >= 0 && a.headers.get("retry-after") !== null ? ra * 1000 : delay;
        if (Date.now() + wait <= deadline) {
          await sleep(wait);
          delay = Math.min(delay * 2, 2000);
          continue;
        }
      }
      return a;
    }
  }

  /** @internal */
  async json<T>(method: string, path: string, body?: unknown, ok: number[] = [200], timeoutMs?: number): Promise<[number, T | undefined]> {
    const data = body === undefined ? undefined : new TextEncoder().encode(JSON.stringify(body));
    const a = await this.send(method, this.base + path, data, data ? { "Content-Type": "application/json" } : {}, timeoutMs);
    if (!ok.includes(a.status)) throw problemOf(a);
    return [a.status, a.body.length ? (JSON.parse(new TextDecoder().decode(a.body)) as T) : undefined];
  }

  /** Calls `path` on the service behind idem as one operation: one
   * idempotency key (`key`, or a new random one) sent with every retry, so
   * idem runs the service once and replays its first answer. A 422
   * mismatch and a 502 upstream-outcome-unknown are thrown, never retried
   * with a new key. */
  async call(method: string, path: string, opts: { json?: unknown; body?: Uint8Array; headers?: Record<string, string>; key?: string } = {}): Promise<CallResponse> {
    const key = opts.key ?? randomKey();
    const h: Record<string, string> = { ...(opts.headers ?? {}), "Idempotency-Key": key };
    let body = opts.body;
    if (opts.json !== undefined) {
      body = new TextEncoder().encode(JSON.stringify(opts.json));
      h["Content-Type"] ??= "application/json";
    }
    const a = await this.send(method, this.base + path, body, h);
    const replayed = a.headers.get("idempotent-replayed") === "true";
    const kind = problemKind(a);
    if (a.status >= 400 && !replayed && kind && ["mismatch", "invalid-key", "missing-key", "upstream-outcome-unknown"].includes(kind)) throw problemOf(a);
    return {
      status: a.status, headers: a.headers, body: a.body, key, replayed,
      json: <T = Json>() => JSON.parse(new TextDecoder().decode(a.body)) as T,
    };
  }

  /** Submits job `id` (its idempotency key): the same again is the same job. */
  async submitJob(id: string, kind: string, params?: unknown, opts: { submissionId?: string } = {}): Promise<JobView> {
    const req: Record<string, unknown> = { id, kind, submission_id: opts.submissionId ?? randomKey() };
    if (params !== undefined) req.params = params;
    const [, j] = await this.json<JobView>("POST", "/v1/jobs", req, [200, 201]);
    return j!;
  }

  async getJob(id: string): Promise<JobView> {
    const [, j] = await this.json<JobView>("GET", "/v1/jobs/" + encodeURIComponent(id));
    return j!;
  }

  /** Delivers `event` to job `id` once, however often it is sent. */
  async signalJob(id: string, event: string, payload?: unknown): Promise<void> {
    await this.json("POST", `/v1/jobs/${encodeURIComponent(id)}/signals/${encodeURIComponent(event)}`, payload === undefined ? {} : { payload }, [202]);
  }

  /** Reads job `id` until it has ended or is parked (at most timeoutMs). */
  async waitJob(id: string, timeoutMs = 60_000, pollMs = 100): Promise<JobView> {
    const end = Date.now() + timeoutMs;
    for (;;) {
      const j = await this.getJob(id);
      if (["succeeded", "failed", "cancelled", "parked"].includes(j.state) || Date.now() > end) return j;
      await sleep(pollMs);
    }
  }

  /** Declares kind `name`: its steps (with `sleep` or `await` for the ones
   * idem runs itself) and its policy (Go duration strings). */
  async declareKind(name: string, steps: StepDeclaration[], policy: KindPolicy = {}): Promise<void> {
    await this.json("PUT", "/v1/kinds/" + encodeURIComponent(name), { name, steps, ...policy });
  }
}

export interface StepDeclaration {
  name: string;
  on_error?: "retry" | "fail" | "compensate";
  compensate?: boolean;
  sleep?: string;
  await?: string;
  timeout?: string;
}

export interface KindPolicy {
  max_attempts?: number;
  backoff?: string;
  max_backoff?: string;
  deadline?: string;
  task_timeout?: string;
}

export interface JobView {
  tenant: string;
  id: string;
  kind: string;
  state: string;
  attempts: number;
  error?: string;
  awaiting?: string;
  params?: Json;
  steps?: { name: string; finished: boolean; output?: Json; output_base64?: string }[];
  [k: string]: unknown;
}

interface TaskJSON {
  task: string;
  job: string;
  kind: string;
  step: string;
  attempt: number;
  token: string;
  step_key: string;
  compensating?: boolean;
  params?: Json;
  params_base64?: string;
  outputs?: Record<string, Json>;
  outputs_base64?: Record<string, string>;
  timeout_ms: number;
}

interface AnswerJSON {
  result: string;
  payload?: Json;
  payload_base64?: string;
  error?: string;
}

/** The step's attempt ended under it: stop; the job resumes from its last
 * recovery point. */
export class TaskGone extends Error {}
/** A sleep or await idem refused: the step stops. */
export class StepFailed extends Error {}
/** An await whose event did not come in time. */
export class AwaitTimeout extends Error {}
class Suspended {} // thrown to unwind a step that waits: not an Error, so a step's catch (e instanceof Error) passes it on

/** What a step's function sees of its job. Send `stepKey` downstream as the
 * effect's idempotency key (the same on every attempt) and `token` as its
 * fencing token (greater on every takeover). */
export class Step {
  readonly task: string;
  readonly job: string;
  readonly kind: string;
  readonly name: string;
  readonly attempt: number;
  readonly token: bigint;
  readonly stepKey: string;
  readonly compensating: boolean;
  readonly timeoutMs: number;
  readonly params: unknown;
  readonly outputs: Record<string, unknown>;
  private seq = 0;

  /** @internal */
  constructor(private readonly client: Client, t: TaskJSON) {
    this.task = t.task;
    this.job = t.job;
    this.kind = t.kind;
    this.name = t.step;
    this.attempt = t.attempt;
    this.token = BigInt(t.token);
    this.stepKey = t.step_key;
    this.compensating = !!t.compensating;
    this.timeoutMs = t.timeout_ms;
    this.params = t.params_base64 !== undefined ? Buffer.from(t.params_base64, "base64") : t.params;
    const outs: Record<string, unknown> = { ...(t.outputs ?? {}) };
    for (const [k, v] of Object.entries(t.outputs_base64 ?? {})) outs[k] = Buffer.from(v, "base64");
    this.outputs = outs;
  }

  /** @internal */
  async report(op: string, body: Record<string, unknown>): Promise<AnswerJSON> {
    // A report is numbered once idem took it: one idem refused (400:
    // nothing changed) or whose outcome is unknown leaves its number to the
    // next, which idem answers as the first if that one landed.
    const seq = this.seq + 1;
    if (op !== "renew") body = { ...body, seq };
    try {
      const [, a] = await this.client.json<AnswerJSON>("POST", `/v1/work/tasks/${encodeURIComponent(this.task)}/${op}`, body);
      if (op !== "renew") this.seq = Math.max(this.seq, seq);
      return a!;
    } catch (e) {
      // Refused (a 400 changes nothing, and takes no number), or gone.
      if (e instanceof ProblemError && e.kind === "task-gone") throw new TaskGone(e.message);
      throw e;
    }
  }

  /** Sleeps durably: the first run of the step to get here ends the attempt
   * (this call does not return) and idem saves the wake-up time; from then
   * on the step runs again from its start and this call returns at once. */
  async sleep(ms: number): Promise<void> {
    const a = await this.report("sleep", { duration_ms: Math.max(1, Math.round(ms)) });
    if (a.result === "suspended") throw new Suspended();
    if (a.result === "failed") throw new StepFailed(a.error ?? "");
  }

  /** Waits durably for `event` of this job, for at most timeoutMs (0: as
   * long as the job is kept), and returns its payload. */
  async awaitEvent(event: string, timeoutMs = 0): Promise<unknown> {
    const body: Record<string, unknown> = { event };
    if (timeoutMs) body.timeout_ms = Math.round(timeoutMs);
    const a = await this.report("await", body);
    switch (a.result) {
      case "suspended":
        throw new Suspended();
      case "timeout":
        throw new AwaitTimeout(`event ${event} did not come in time`);
      case "failed":
        throw new StepFailed(a.error ?? "");
    }
    return a.payload_base64 !== undefined ? Buffer.from(a.payload_base64, "base64") : a.payload;
  }
}

export type StepFunc = (s: Step) => Promise<unknown> | unknown;

/** Runs the steps of `kinds` with `steps` (a function per step name). A
 * step function returns its output (JSON, a Uint8Array, or undefined), which
 * idem saves as the step's recovery point; a throw fails the step, and the
 * kind's on_error decides. */
export class Worker {
  private stopped = false;
  private abort = new AbortController();

  constructor(
    readonly client: Client,
    readonly kinds: string[],
    readonly steps: Record<string, StepFunc>,
    readonly opts: { undo?: Record<string, StepFunc>; waitMs?: number } = {},
  ) {}

  /** Makes run() return once its current step ends. */
  stop(): void {
    this.stopped = true;
  }

  /** Waits for a step to run (undefined if none came within the wait). */
  async next(): Promise<Step | undefined> {
    const wait = this.opts.waitMs ?? 30_000;
    const [, t] = await this.client.json<TaskJSON>("POST", "/v1/work/next", { kinds: this.kinds, wait_ms: wait }, [200, 204], wait + 30_000);
    return t ? new Step(this.client, t) : undefined;
  }

  /** Runs steps until stop(). */
  async run(): Promise<void> {
    while (!this.stopped) {
      let s: Step | undefined;
      try {
        s = await this.next();
      } catch (e) {
        if (e instanceof ProblemError && e.status < 500) throw e;
        await sleep(1000);
        continue;
      }
      if (s) await this.runStep(s);
    }
  }

  /** Runs one step and reports how it ended. */
  async runStep(s: Step): Promise<void> {
    const fn = (s.compensating ? this.opts.undo ?? {} : this.steps)[s.name];
    const renew = setInterval(() => {
      s.report("renew", {}).catch(() => {});
    }, Math.max(s.timeoutMs / 3, 200));
    let out: unknown;
    try {
      if (!fn) throw new Error(`this worker has no function for step ${s.name} of kind ${s.kind}`);
      out = await fn(s);
    } catch (e) {
      clearInterval(renew);
      if (e instanceof Suspended || e instanceof TaskGone) return;
      await this.end(s, "fail", { error: (e instanceof Error ? `${e.name}: ${e.message}` : String(e)).slice(0, 4000) || "error" });
      return;
    }
    clearInterval(renew);
    const body: Record<string, unknown> = {};
    if (out instanceof Uint8Array) body.output_base64 = Buffer.from(out).toString("base64");
    else if (out !== undefined) body.output = out;
    await this.end(s, "done", body);
  }

  private async end(s: Step, op: string, body: Record<string, unknown>): Promise<void> {
    try {
      await s.report(op, body);
    } catch {
      // Gone, or not known to have landed: the step runs again elsewhere
      // (its effects keyed by stepKey).
    }
  }
}
