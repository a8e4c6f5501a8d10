// A worker process for the tests: runs the order kind's steps, and hangs in
// the step named by BLOCK_IN after its effect (to be killed).
import { Client, Worker, type Step } from "../src/index.js";

async function effect(sink: string, s: Step, enter = false): Promise<void> {
  const r = await fetch(sink, { method: "POST", headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ key: s.stepKey, token: s.token.toString(), job: s.job, enter }) });
  await r.arrayBuffer();
}

export function steps(sink: string, blockIn: string) {
  return {
    charge: async (s: Step) => {
      await effect(sink, s);
      await s.sleep(300); // durable: the attempt ends here, and the step runs again after
      return { charge: "ch_" + s.job };
    },
    approve: async (s: Step) => {
      const by = await s.awaitEvent("approved", 60_000);
      await effect(sink, s);
      return by;
    },
    ship: async (s: Step) => {
      await effect(sink, s, s.name === blockIn);
      if (s.name === blockIn) await new Promise(() => setInterval(() => {}, 1000)); // killed here
      return "shipped";
    },
  };
}

if (process.argv[2] === "run") {
  const w = new Worker(new Client(process.env.IDEM_URL!), [process.env.KIND!], steps(process.env.SINK_URL!, process.env.BLOCK_IN ?? ""), { waitMs: 5000 });
  await w.run();
}
