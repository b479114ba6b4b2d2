// The chat playground: a conversation with one model over POST /v1/chat/completions
// (streamed), with the model's reasoning folded away, tool calls shown with their
// arguments and answered by hand, pasted or dropped images, the sampling settings, stop,
// regenerate, edit-and-resend, and per reply its prompt / cached / generated tokens,
// time to first token and tokens per second.

import { headers, httpError, readEvents } from "./api.js";
import { fill, fmtRate, fmtSeconds, h } from "./dom.js";
import { renderMarkdown } from "./markdown.js";

const $ = (id) => document.getElementById(id);

export class ChatView {
  constructor(models) {
    this.messages = []; // {role, content, images?, reasoning?, tool_calls?, tool_call_id?, stats?, error?}
    this.images = []; // data URLs waiting to go with the next message
    this.control = null; // the running reply's AbortController
    this.models = models.data.filter((m) => !m.alias_of);
    fill($("model"), this.models.map((m) => h("option", { value: m.id }, modelLabel(m))));
    $("model").addEventListener("change", () => this.noteModel());
    this.noteModel();
    $("composer").addEventListener("submit", (ev) => {
      ev.preventDefault();
      this.submit();
    });
    $("prompt").addEventListener("keydown", (ev) => {
      if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
        ev.preventDefault();
        this.submit();
      }
    });
    $("stop-reply").addEventListener("click", () => this.control?.abort());
    $("new-chat").addEventListener("click", () => {
      if (this.control) return;
      this.messages = [];
      this.render();
    });
    $("prompt").addEventListener("paste", (ev) => this.takeImages(ev.clipboardData?.files));
    const area = document.querySelector(".conversation");
    area.addEventListener("dragover", (ev) => ev.preventDefault());
    area.addEventListener("drop", (ev) => {
      ev.preventDefault();
      this.takeImages(ev.dataTransfer?.files);
    });
    this.render();
  }

  get model() {
    return this.models.find((m) => m.id === $("model").value);
  }

  noteModel() {
    const m = this.model;
    const vision = m?.capabilities?.vision;
    $("model-note").textContent = !m
      ? "No model is configured."
      : `${m.loaded ? "loaded" : "not loaded (the first message loads it)"}` +
        (m.context_length ? ` · ${m.context_length} tokens of context` : "") +
        (vision === false ? " · takes no images" : vision ? " · takes images" : "");
  }

  // -- images --------------------------------------------------------------------------
  takeImages(files) {
    for (const file of files ?? []) {
      if (!file.type.startsWith("image/")) continue;
      const reader = new FileReader();
      reader.addEventListener("load", () => {
        this.images.push(reader.result);
        this.renderAttachments();
      });
      reader.readAsDataURL(file);
    }
  }

  renderAttachments() {
    fill($("attachments"), this.images.map((url, i) =>
      h("figure", { class: "thumb" }, h("img", { src: url, alt: "an image to send" }),
        h("button", { type: "button", title: "Remove", onclick: () => {
          this.images.splice(i, 1);
          this.renderAttachments();
        } }, "×"))));
  }

  // -- sending -------------------------------------------------------------------------
  submit() {
    const text = $("prompt").value;
    if (this.control || (!text.trim() && !this.images.length)) return;
    this.messages.push({ role: "user", content: text, images: this.images });
    this.images = [];
    $("prompt").value = "";
    this.renderAttachments();
    this.send();
  }

  request() {
    const body = { model: $("model").value, stream: true, stream_options: { include_usage: true } };
    for (const name of ["temperature", "top_p", "top_k", "max_tokens", "seed"]) {
      const value = $(name).value.trim();
      if (value !== "") body[name] = Number(value);
    }
    const stop = $("stop").value.split("\n").filter((s) => s !== "");
    if (stop.length) body.stop = stop;
    const tools = this.tools();
    if (tools.length) body.tools = tools;
    const system = $("system").value;
    body.messages = [...(system.trim() ? [{ role: "system", content: system }] : []),
      ...this.messages.map(wireMessage)];
    return body;
  }

  tools() {
    const text = $("tools").value.trim();
    $("tools-error").textContent = "";
    if (!text) return [];
    let tools;
    try {
      tools = JSON.parse(text);
    } catch (err) {
      throw new Error(`The tools are not JSON: ${err.message}`);
    }
    if (!Array.isArray(tools)) tools = [tools];
    return tools.map((t) => (t.type === "function" ? t : { type: "function", function: t }));
  }

  async send() {
    let body;
    try {
      body = this.request();
    } catch (err) {
      $("tools-error").textContent = err.message;
      return;
    }
    const reply = { role: "assistant", content: "", reasoning: "", tool_calls: [] };
    this.messages.push(reply);
    this.control = new AbortController();
    this.busy(true);
    this.render();
    const started = performance.now();
    let first = null;
    let usage = null;
    let pieces = 0; // deltas with output: the tokens generated, when no usage comes (stopped)
    try {
      const response = await fetch("/v1/chat/completions", {
        method: "POST",
        headers: headers({ "Content-Type": "application/json" }),
        body: JSON.stringify(body),
        signal: this.control.signal,
      });
      if (!response.ok) throw await httpError(response);
      await readEvents(response, (_, data) => {
        if (data === "[DONE]") return;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        if (chunk.usage) usage = chunk.usage;
        for (const choice of chunk.choices ?? []) {
          if (merge(reply, choice.delta ?? {})) {
            pieces += 1;
            if (first === null) first = performance.now();
          }
          if (choice.finish_reason) reply.finish = choice.finish_reason;
        }
        this.update(reply);
      });
    } catch (err) {
      if (err.name === "AbortError") reply.finish = "stopped";
      else reply.error = err.message;
    } finally {
      reply.stats = stats(usage, pieces, started, first, performance.now());
      this.control = null;
      this.busy(false);
      this.render();
    }
  }

  busy(on) {
    $("send").disabled = on;
    $("stop-reply").disabled = !on;
  }

  // -- the transcript ------------------------------------------------------------------
  render() {
    const last = this.messages.length - 1;
    fill($("transcript"), this.messages.length
      ? this.messages.map((m, i) => this.renderMessage(m, i, i === last))
      : h("p", { class: "empty" }, "Start a conversation below."));
    this.scroll();
  }

  // the streaming reply, at most once a frame
  update(reply) {
    if (this.pending) return;
    this.pending = requestAnimationFrame(() => {
      this.pending = null;
      const el = $("transcript").lastElementChild;
      if (el && this.messages.at(-1) === reply) {
        el.replaceWith(this.renderMessage(reply, this.messages.length - 1, true));
        this.scroll();
      }
    });
  }

  scroll() {
    const t = $("transcript");
    t.scrollTop = t.scrollHeight;
  }

  renderMessage(m, i, last) {
    if (m.role === "user") return this.renderUser(m, i);
    if (m.role === "tool") {
      return h("div", { class: "msg tool" }, h("div", { class: "who" }, `tool result · ${m.tool_call_id}`),
        h("pre", {}, m.content));
    }
    const el = h("div", { class: "msg assistant" }, h("div", { class: "who" }, "assistant"));
    if (m.reasoning) {
      const details = h("details", { class: "reasoning", open: Boolean(m.open) },
        h("summary", {}, "Reasoning"), h("div", { class: "md" }, renderMarkdown(m.reasoning)));
      details.addEventListener("toggle", () => (m.open = details.open)); // kept as it streams
      el.append(details);
    }
    if (m.content) el.append(h("div", { class: "md content" }, renderMarkdown(m.content)));
    for (const call of m.tool_calls ?? []) el.append(this.renderCall(call, i));
    if (m.error) el.append(h("p", { class: "error" }, m.error));
    if (m.stats) el.append(renderStats(m.stats, m.finish));
    else if (!m.content && !m.reasoning) el.append(h("p", { class: "note" }, "…"));
    if (last && m.stats && !this.control) {
      el.append(h("div", { class: "actions" },
        h("button", { type: "button", onclick: () => this.regenerate() }, "Regenerate")));
    }
    return el;
  }

  renderUser(m, i) {
    const el = h("div", { class: "msg user" }, h("div", { class: "who" }, "you"),
      h("div", { class: "text" }, m.content),
      m.images?.length ? h("div", { class: "attachments" }, m.images.map((url) =>
        h("img", { src: url, alt: "a sent image" }))) : null);
    const edit = h("button", { type: "button", onclick: () => this.edit(el, i) }, "Edit");
    el.append(h("div", { class: "actions" }, edit));
    edit.disabled = Boolean(this.control);
    return el;
  }

  renderCall(call, i) {
    let args = call.function.arguments;
    try {
      args = JSON.stringify(JSON.parse(args), null, 2);
    } catch {
      // still streaming, or not JSON: shown as it came
    }
    const el = h("div", { class: "tool-call" },
      h("div", { class: "who" }, `call ${call.function.name}`, h("span", { class: "note" }, ` ${call.id}`)),
      h("pre", {}, args));
    const answered = this.messages.some((m) => m.role === "tool" && m.tool_call_id === call.id);
    if (!answered && !this.control && this.messages[i].stats) {
      const result = h("textarea", { rows: 2, placeholder: `What ${call.function.name} returned` });
      const send = h("button", { type: "button" }, "Send result");
      send.addEventListener("click", () => this.answer(i, call, result.value));
      el.append(h("div", { class: "answer" }, result, send));
    }
    return el;
  }

  // -- regenerate, edit, answer ----------------------------------------------------------
  regenerate() {
    if (this.control || this.messages.at(-1)?.role !== "assistant") return;
    this.messages.pop();
    this.send();
  }

  edit(el, i) {
    if (this.control) return;
    const message = this.messages[i];
    const text = h("textarea", { rows: 3, value: message.content });
    const resend = h("button", { type: "button" }, "Resend");
    const cancel = h("button", { type: "button", onclick: () => this.render() }, "Cancel");
    resend.addEventListener("click", () => {
      this.messages = this.messages.slice(0, i);
      this.messages.push({ ...message, content: text.value });
      this.send();
    });
    fill(el, h("div", { class: "who" }, "you (editing)"), text, h("div", { class: "actions" }, resend, cancel));
    text.focus();
  }

  answer(i, call, content) {
    if (this.control) return;
    // after the calling reply and the results given so far
    let at = i + 1;
    while (at < this.messages.length && this.messages[at].role === "tool") at += 1;
    this.messages.splice(at, 0, { role: "tool", tool_call_id: call.id, content });
    const calls = this.messages[i].tool_calls;
    const open = calls.filter((c) => !this.messages.some((m) => m.role === "tool" && m.tool_call_id === c.id));
    if (open.length || at !== this.messages.length - 1) this.render();
    else this.send(); // every call answered: the model goes on
  }
}

function modelLabel(m) {
  return m.loaded ? m.id : `${m.id} (not loaded)`;
}

// A message as the API takes it.
function wireMessage(m) {
  if (m.role === "tool") return { role: "tool", tool_call_id: m.tool_call_id, content: m.content };
  if (m.role === "assistant") {
    const out = { role: "assistant", content: m.content };
    if (m.tool_calls?.length) out.tool_calls = m.tool_calls;
    return out;
  }
  if (!m.images?.length) return { role: "user", content: m.content };
  return { role: "user", content: [{ type: "text", text: m.content },
    ...m.images.map((url) => ({ type: "image_url", image_url: { url } }))] };
}

// Adds a streamed delta to the reply; true when it carried output.
function merge(reply, delta) {
  let any = false;
  if (delta.content) {
    reply.content += delta.content;
    any = true;
  }
  // the server sends both names with the same text: one is read
  const reasoning = delta.reasoning_content ?? delta.reasoning;
  if (reasoning) {
    reply.reasoning += reasoning;
    any = true;
  }
  for (const part of delta.tool_calls ?? []) {
    const call = (reply.tool_calls[part.index ?? 0] ??= { id: "", type: "function", function: { name: "", arguments: "" } });
    if (part.id) call.id = part.id;
    if (part.function?.name) call.function.name += part.function.name;
    if (part.function?.arguments) call.function.arguments += part.function.arguments;
    any = true;
  }
  return any;
}

function stats(usage, pieces, started, first, ended) {
  const generated = usage?.completion_tokens ?? pieces;
  const decode = first === null ? 0 : (ended - first) / 1000;
  return {
    prompt: usage?.prompt_tokens ?? null,
    cached: usage?.prompt_tokens_details?.cached_tokens ?? null,
    generated,
    counted: !usage, // no usage came: `generated` counts the pieces streamed
    ttft: first === null ? null : (first - started) / 1000,
    rate: generated > 1 && decode > 0 ? (generated - 1) / decode : null,
  };
}

function renderStats(s, finish) {
  const show = (n) => (n === null ? "–" : String(n));
  const el = h("div", { class: "stats" },
    `prompt ${show(s.prompt)} · cached ${show(s.cached)} · generated ${s.counted ? "≈" : ""}${show(s.generated)}`,
    ` · TTFT ${fmtSeconds(s.ttft)} · ${fmtRate(s.rate)}`, finish ? ` · ${finish}` : "");
  el.dataset.prompt = show(s.prompt);
  el.dataset.cached = show(s.cached);
  el.dataset.generated = show(s.generated);
  return el;
}
