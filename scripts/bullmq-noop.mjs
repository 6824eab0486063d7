// The queue users would pick instead, for `make bench-queues`: BullMQ's
// no-op worker on the same records. `add PORT N FILE` adds one job a line
// of FILE (a JSONL dataset); `work PORT N CONCURRENCY` processes them with a
// worker whose processor does nothing, prints `done` once N completed, and
// closes. BullMQ's defaults otherwise (completed jobs are kept).
import { readFileSync } from 'node:fs';
import { Queue, Worker } from 'bullmq';
import IORedis from 'ioredis';

const [mode, port, n, third] = process.argv.slice(2);
// In ESM BullMQ takes a client, not connection options.
const connection = new IORedis({ host: '127.0.0.1', port: Number(port), maxRetriesPerRequest: null });

if (mode === 'add') {
  const queue = new Queue('bench', { connection });
  const lines = readFileSync(third, 'utf8').split('\n').filter(Boolean);
  for (let i = 0; i < lines.length; i += 1000) {
    await queue.addBulk(lines.slice(i, i + 1000).map((l) => ({ name: 'record', data: JSON.parse(l) })));
  }
  await queue.close();
  connection.disconnect();
} else {
  let completed = 0;
  const worker = new Worker('bench', async () => {}, { connection, concurrency: Number(third) });
  await new Promise((resolve) => {
    worker.on('completed', () => {
      completed += 1;
      if (completed === Number(n)) resolve();
    });
  });
  process.stdout.write('done\n');
  await worker.close();
  connection.disconnect();
}
