// Per-token cost of the client's real read path: socket reads, line splitting, JSON.parse,
// dispatch, and the async iterator (or the onToken callback), on token lines served from
// memory by a fake daemon over a Unix socket.
//
//   node clients/node/bench/tokens.js [N]        (default 100000 tokens per run)

import fs from "node:fs";
import net from "node:net";
import os from "node:os";
import path from "node:path";
import { connect } from "../index.js";

const n = Number(process.argv[2] ?? 100000);
const pieces = [" the", " 日本", "の", " café", ",", "\n", ' "quoted"', " model", "’s", " 2019"];
const lines = [];
for (let i = 0; i < n; i++) {
  lines.push(JSON.stringify({ type: "token", id: 1, text: pieces[i % pieces.length] }));
}
const body = Buffer.from(`${lines.join("\n")}\n`);

const dir = fs.mkdtempSync(path.join(os.tmpdir(), "sfnb"));
const socketPath = path.join(dir, "d.sock");
const server = net.createServer((socket) => {
  let buffered = "";
  socket.on("data", (chunk) => {
    buffered += chunk;
    let end;
    while ((end = buffered.indexOf("\n")) !== -1) {
      const request = JSON.parse(buffered.slice(0, end));
      buffered = buffered.slice(end + 1);
      if (request.id !== 1) throw new Error("the recorded lines carry id 1");
      socket.write(body);
      socket.write('{"type":"done","id":1,"text":"","finish_reason":"length",' +
        '"stop_sequence":null,"usage":{"prompt_tokens":4,"cached_tokens":0,' +
        `"completion_tokens":${n}},"timings":{}}\n`);
    }
  });
});
await new Promise((resolve) => server.listen(socketPath, resolve));

const client = await connect(socketPath);
const results = {};
for (const mode of ["asyncIterator", "onToken", "asyncIterator", "onToken"]) {
  let count = 0;
  const start = process.hrtime.bigint();
  if (mode === "asyncIterator") {
    for await (const piece of client.streamGenerate("p", { id: 1 })) count += piece.length > 0;
  } else {
    await client.generate("p", { id: 1, onToken: (piece) => { count += piece.length > 0; } });
  }
  const us = Number(process.hrtime.bigint() - start) / 1000 / n;
  if (count !== n) throw new Error(`${mode}: ${count} pieces of ${n}`);
  results[mode] = Math.min(results[mode] ?? Infinity, us);
}
await client.close();
server.close();
fs.rmSync(dir, { recursive: true, force: true });
for (const [mode, us] of Object.entries(results)) {
  console.log(`${mode}: ${us.toFixed(3)} us per token (${n} tokens, best of 2)`);
}
