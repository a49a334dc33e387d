// The chat page of `minivllm serve`: a conversation streamed from the server's own
// /v1/chat/completions. Stop aborts the fetch, which closes the connection; the server
// then aborts the request in the engine. No framework, no build step, no network beyond
// this server.
"use strict";

const $ = (id) => document.getElementById(id);
const SAMPLING_FIELDS = ["temperature", "top_p", "top_k", "min_p", "repetition_penalty",
  "max_tokens", "seed"];
const INTEGER_FIELDS = new Set(["top_k", "max_tokens", "seed"]);
const STORE = "minivllm-chat";

const state = {
  messages: [],       // the conversation sent to the server: {role, content}
  controller: null,   // the AbortController of the answer being streamed
  model: null,
  apiKey: localStorage.getItem(`${STORE}-api-key`) || "",
};

// ------------------------------------------------------------------ settings

function loadSettings() {
  const saved = JSON.parse(localStorage.getItem(`${STORE}-settings`) || "{}");
  for (const id of [...SAMPLING_FIELDS, "system-prompt", "extra-body"]) {
    if (saved[id] !== undefined) $(id).value = saved[id];
  }
}

function saveSettings() {
  const values = {};
  for (const id of [...SAMPLING_FIELDS, "system-prompt", "extra-body"]) values[id] = $(id).value;
  localStorage.setItem(`${STORE}-settings`, JSON.stringify(values));
}

// The request body's sampling fields: only those the user filled in.
function samplingParams() {
  const params = {};
  for (const name of SAMPLING_FIELDS) {
    const text = $(name).value.trim();
    if (text === "") continue;
    const value = INTEGER_FIELDS.has(name) ? parseInt(text, 10) : parseFloat(text);
    if (!Number.isNaN(value)) params[name] = value;
  }
  const extra = $("extra-body").value.trim();
  if (extra) Object.assign(params, JSON.parse(extra)); // a parse error is shown to the user
  return params;
}

// ------------------------------------------------------------------ server

function headers() {
  const h = { "Content-Type": "application/json" };
  if (state.apiKey) h.Authorization = `Bearer ${state.apiKey}`;
  return h;
}

async function errorMessage(response) {
  try {
    const body = await response.json();
    return (body.error && body.error.message) || JSON.stringify(body);
  } catch (_) {
    return `${response.status} ${response.statusText}`;
  }
}

// Asks for the API key (a modal dialog) until /v1/models accepts it.
async function connect() {
  for (;;) {
    const response = await fetch("v1/models", { headers: headers() });
    if (response.ok) {
      const body = await response.json();
      state.model = body.data.length ? body.data[0].id : null;
      $("model-name").textContent = state.model || "";
      if (body.data.length > 1) showModelPicker(body.data);
      return;
    }
    if (response.status !== 401) {
      $("model-name").textContent = `server error: ${await errorMessage(response)}`;
      return;
    }
    $("api-key-error").hidden = !state.apiKey;
    state.apiKey = await askApiKey();
    localStorage.setItem(`${STORE}-api-key`, state.apiKey);
  }
}

// A server with several models (a many-model server lists each with its `state`): the
// picker chooses the one the chat talks to; a model not loaded loads on its first request.
function showModelPicker(cards) {
  const picker = $("model-picker");
  const saved = localStorage.getItem(`${STORE}-model`);
  picker.replaceChildren(...cards.map((card) => {
    const option = document.createElement("option");
    option.value = card.id;
    option.textContent = card.state ? `${card.id} (${card.state})` : card.id;
    return option;
  }));
  if (cards.some((card) => card.id === saved)) state.model = saved;
  picker.value = state.model;
  picker.hidden = false;
  $("model-name").hidden = true;
  picker.addEventListener("change", () => {
    state.model = picker.value;
    localStorage.setItem(`${STORE}-model`, state.model);
  });
}

function askApiKey() {
  const dialog = $("api-key-dialog");
  return new Promise((resolve) => {
    dialog.addEventListener("close", () => resolve($("api-key").value.trim()), { once: true });
    dialog.showModal();
    $("api-key").focus();
  });
}

// Yields the parsed JSON of each `data:` event of a server-sent event stream.
async function* sseEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

// ------------------------------------------------------------------ conversation view

function addMessage(role, text) {
  const wrapper = document.createElement("div");
  wrapper.className = `message ${role}`;
  const body = document.createElement("div");
  body.className = "content";
  wrapper.appendChild(body);
  const footer = document.createElement("div");
  footer.className = "stats muted";
  wrapper.appendChild(footer);
  $("messages").appendChild(wrapper);
  setContent(wrapper, role, text);
  return wrapper;
}

function setContent(wrapper, role, text) {
  const body = wrapper.querySelector(".content");
  if (role === "assistant") body.innerHTML = Markdown.render(text);
  else body.textContent = text;
  const box = $("messages");
  box.scrollTop = box.scrollHeight;
}

function setBusy(busy) {
  document.body.classList.toggle("busy", busy);
  $("send").disabled = busy;
  $("stop").hidden = !busy;
}

function statsLine({ tokens, firstTokenAt, startedAt, endedAt, stopped }) {
  const parts = [`${tokens} tokens`];
  if (tokens > 1 && endedAt > firstTokenAt) {
    // The decode rate: tokens after the first over the time after the first.
    parts.push(`${((tokens - 1) / ((endedAt - firstTokenAt) / 1000)).toFixed(1)} tokens/s`);
  }
  if (firstTokenAt) parts.push(`first token ${((firstTokenAt - startedAt) / 1000).toFixed(2)} s`);
  if (stopped) parts.push("stopped");
  return parts.join(" · ");
}

// ------------------------------------------------------------------ sending

async function send(text) {
  const system = $("system-prompt").value.trim();
  const userMessage = { role: "user", content: text };
  addMessage("user", text);
  const wrapper = addMessage("assistant", "");
  wrapper.classList.add("streaming");
  let params;
  try {
    params = samplingParams();
  } catch (err) {
    showError(wrapper, `The extra request fields are not valid JSON: ${err.message}`);
    return;
  }
  const messages = [...(system ? [{ role: "system", content: system }] : []),
    ...state.messages, userMessage];
  // A person waits on this answer: the server's slo policy serves it as latency-sensitive
  // (its default targets); the extra fields may say otherwise.
  const body = {
    model: state.model || undefined, messages, stream: true,
    stream_options: { include_usage: true }, is_latency_sensitive: true, ...params,
  };
  const controller = new AbortController();
  state.controller = controller;
  setBusy(true);
  const stats = { tokens: 0, chunks: 0, startedAt: performance.now(), firstTokenAt: 0,
    endedAt: 0, stopped: false };
  let answer = "";
  try {
    const response = await fetch("v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: controller.signal,
    });
    if (!response.ok) {
      if (response.status === 401) { state.apiKey = ""; connect(); }
      throw new Error(await errorMessage(response));
    }
    for await (const chunk of sseEvents(response)) {
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) stats.tokens = chunk.usage.completion_tokens;
      const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
      if (delta && delta.content) {
        if (!stats.firstTokenAt) stats.firstTokenAt = performance.now();
        stats.chunks += 1;
        answer += delta.content;
        setContent(wrapper, "assistant", answer);
      }
    }
  } catch (err) {
    if (err.name === "AbortError") stats.stopped = true;
    else showError(wrapper, err.message);
  } finally {
    stats.endedAt = performance.now();
    // A stopped answer has no usage chunk: one streamed chunk is one token.
    if (!stats.tokens) stats.tokens = stats.chunks;
    state.controller = null;
    setBusy(false);
    wrapper.classList.remove("streaming");
    wrapper.classList.add(stats.stopped ? "stopped" : "done");
    if (answer) {
      // A stopped answer stays in the history, as written so far.
      state.messages.push(userMessage, { role: "assistant", content: answer });
      wrapper.querySelector(".stats").textContent = statsLine(stats);
    }
  }
}

function showError(wrapper, message) {
  wrapper.classList.add("error");
  const p = document.createElement("p");
  p.className = "error";
  p.textContent = message;
  wrapper.querySelector(".content").appendChild(p);
}

// ------------------------------------------------------------------ wiring

$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || state.controller) return;
  $("prompt").value = "";
  send(text);
});

$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    $("composer").requestSubmit();
  }
});

$("stop").addEventListener("click", () => {
  if (state.controller) state.controller.abort();
});

$("new-chat").addEventListener("click", () => {
  if (state.controller) state.controller.abort();
  state.messages = [];
  $("messages").innerHTML = "";
  $("prompt").focus();
});

$("toggle-settings").addEventListener("click", () => {
  const panel = $("settings");
  panel.hidden = !panel.hidden;
  $("toggle-settings").setAttribute("aria-expanded", String(!panel.hidden));
});

$("settings").addEventListener("input", saveSettings);

$("messages").addEventListener("click", (event) => {
  if (!event.target.classList.contains("copy-code")) return;
  const code = event.target.closest(".code-block").querySelector("code").textContent;
  navigator.clipboard.writeText(code).then(() => { event.target.textContent = "Copied"; },
    () => { event.target.textContent = "Copy failed"; });
});

loadSettings();
connect();
$("prompt").focus();
