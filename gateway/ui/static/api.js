// Talking to the server: the key (kept in this tab's session storage), JSON requests,
// and server-sent events read from a fetch response (EventSource cannot send a key).

const KEY = "mlx-gateway-key";

export const auth = {
  // whether the server has an API key (the page's <meta>, filled in by the server)
  get required() {
    return document.querySelector('meta[name="mlx-gateway-key"]')?.content === "required";
  },
  get key() {
    return sessionStorage.getItem(KEY);
  },
  set(key) {
    sessionStorage.setItem(KEY, key);
  },
  clear() {
    sessionStorage.removeItem(KEY);
  },
};

export function headers(extra = {}) {
  const out = { ...extra };
  const key = auth.key;
  if (key) out.Authorization = `Bearer ${key}`;
  return out;
}

export class HttpError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

export async function httpError(response) {
  let message = `${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    message = body?.error?.message ?? message;
  } catch {
    // not JSON: the status says enough
  }
  return new HttpError(response.status, message);
}

export async function getJSON(path, signal) {
  const response = await fetch(path, { headers: headers(), signal });
  if (!response.ok) throw await httpError(response);
  return response.json();
}

// Calls onEvent(name, data) for each event of a text/event-stream response, until it ends
// (an exception thrown by onEvent ends the reading and propagates).
export async function readEvents(response, onEvent) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value.replaceAll("\r", "");
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        let name = "message";
        const data = [];
        for (const line of block.split("\n")) {
          if (line.startsWith("event:")) name = line.slice(6).trim();
          else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
        }
        if (data.length) onEvent(name, data.join("\n"));
      }
    }
  } finally {
    reader.releaseLock();
  }
}

const RETRY_MS = 2000;

// Follows GET /admin/events: onState(document) for each state, onStatus(text) as the
// connection changes, onRefused() on a 401 (then it stops). Reconnects after a pause
// when the stream breaks. Returns a function that stops it.
export function watchState(onState, onStatus, onRefused) {
  const control = new AbortController();
  const run = async () => {
    while (!control.signal.aborted) {
      try {
        onStatus("connecting…");
        const response = await fetch("/admin/events", { headers: headers(), signal: control.signal });
        if (response.status === 401) {
          onRefused();
          return;
        }
        if (!response.ok) throw await httpError(response);
        onStatus("live");
        await readEvents(response, (name, data) => {
          if (name === "state") onState(JSON.parse(data));
        });
        onStatus("disconnected");
      } catch (err) {
        if (control.signal.aborted) return;
        onStatus(`disconnected (${err.message}); retrying`);
      }
      await new Promise((resolve) => setTimeout(resolve, RETRY_MS));
    }
  };
  run();
  return () => control.abort();
}
