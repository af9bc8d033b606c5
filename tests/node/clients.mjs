// The Node examples of docs/api.md, run against a launched app: `node clients.mjs http://127.0.0.1:PORT/`.
// Prints one JSON object of what each client saw; tests/web/test_node.py checks it.
import { Client } from "@gradio/client";
import OpenAI from "openai";
import { Client as McpClient } from "@modelcontextprotocol/sdk/client/index.js";
import { StreamableHTTPClientTransport } from "@modelcontextprotocol/sdk/client/streamableHttp.js";

const url = process.argv[2];
const seen = {};

// @gradio/client: a positional predict leaves out the optional inputs (lora, lora_scale): Gradio pads them with
// null, and the app takes their defaults.
const app = await Client.connect(url, { events: ["data", "status"] });
const made = await app.predict("/generate", ["a fox", "64x64", 1, 7]);
seen.gradio = { record: made.data[1], image: typeof made.data[0]?.url };

// A refused request: with events ["data", "status"], the refusal arrives as a status event with the message.
const refusals = [];
for await (const message of app.submit("/generate", ["a fox", "64x64", 99, 7])) {
  if (message.type === "status" && message.stage === "error") {
    refusals.push(message.message);
    break;
  }
  if (message.type === "data") break;
}
seen.gradio.refusal = refusals[0] ?? null;
const api = await app.view_api();
seen.gradio.labels = api.named_endpoints["/generate"].parameters.map((p) => p.label);

// openai: the extensions (seed, num_inference_steps) go at the top level of the body in the Node SDK;
// .withResponse() reads the headers; maxRetries: 0 so a 429 answers at once instead of being retried.
const openai = new OpenAI({ baseURL: `${url}v1`, apiKey: "unused", maxRetries: 0 });
const { data: image, response } = await openai.images
  .generate({ prompt: "a fox", size: "64x64", seed: 3, num_inference_steps: 1 })
  .withResponse();
seen.openai = { size: image.size, b64: image.data[0].b64_json.length > 100, type: response.headers.get("content-type") };
try {
  await openai.images.generate({ prompt: "a fox", size: "64x64", response_format: "jpeg" });
} catch (error) {
  seen.openai.refusal = { status: error.status, code: error.code, param: error.param };
}
// A job (Prefer: respond-async), polled with client.get().
const job = await openai.post("/images/generations", {
  body: { prompt: "a fox", size: "64x64", num_inference_steps: 1 },
  headers: { Prefer: "respond-async" },
});
let view = job;
for (let i = 0; i < 600 && !["succeeded", "failed"].includes(view.status); i++) {
  await new Promise((done) => setTimeout(done, 100));
  view = await openai.get(`/images/jobs/${job.id}`);
}
seen.openai.job = { status: view.status, images: view.data?.length ?? 0 };

// Streaming: stream: true with partial_images, the events as the SDK parses them; a bad partial_images is a 400
// before any stream.
const events = [];
for await (const event of await openai.images.generate({ prompt: "a fox", size: "64x64", stream: true, partial_images: 2 })) {
  events.push(event);
}
seen.openai.stream = {
  types: events.map((e) => e.type),
  indexes: events.filter((e) => e.type === "image_generation.partial_image").map((e) => e.partial_image_index),
  completed: events.at(-1)?.b64_json ?? null,
};
try {
  await openai.images.generate({ prompt: "a fox", size: "64x64", stream: true, partial_images: 9 });
} catch (error) {
  seen.openai.stream.refusal = { status: error.status, param: error.param };
}

// MCP: the named endpoints as tools, over streamable HTTP.
const mcp = new McpClient({ name: "node-example", version: "1.0.0" });
await mcp.connect(new StreamableHTTPClientTransport(new URL(`${url}gradio_api/mcp/`)));
const tools = await mcp.listTools();
seen.mcp = { tools: tools.tools.map((t) => t.name).sort() };
const status = await mcp.callTool({ name: "status", arguments: {} });
seen.mcp.status = status.content.map((c) => c.type);
await mcp.close();

console.log(JSON.stringify(seen));
process.exit(0);
