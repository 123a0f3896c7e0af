// The chat page of `cpullm serve`: plain JavaScript over /v1/models and the streamed
// /v1/chat/completions, conversations kept in the browser's local storage.
"use strict";

const $ = (id) => document.getElementById(id);
const STORE = "cpullm.conversations";
const CURRENT = "cpullm.current";
const SETTINGS = "cpullm.settings";

let conversations = JSON.parse(localStorage.getItem(STORE) || "[]");
let current = localStorage.getItem(CURRENT);
let model = null;
let running = null; // the AbortController of the answer being streamed

function save() {
  localStorage.setItem(STORE, JSON.stringify(conversations));
  localStorage.setItem(CURRENT, current || "");
}

function conversation() {
  let found = conversations.find((c) => c.id === current);
  if (!found) {
    found = { id: String(Date.now()), title: "New conversation", messages: [] };
    conversations.unshift(found);
    current = found.id;
  }
  return found;
}

function headers() {
  const key = $("api-key").value.trim();
  const given = { "Content-Type": "application/json" };
  if (key) given.Authorization = "Bearer " + key;
  return given;
}

// ---- settings

const FIELDS = ["system-prompt", "temperature", "top-p", "max-tokens", "api-key"];

function loadSettings() {
  const saved = JSON.parse(localStorage.getItem(SETTINGS) || "{}");
  for (const id of FIELDS) if (saved[id] !== undefined) $(id).value = saved[id];
}

function saveSettings() {
  const saved = {};
  for (const id of FIELDS) saved[id] = $(id).value;
  localStorage.setItem(SETTINGS, JSON.stringify(saved));
}

function number(id, fallback) {
  const value = parseFloat($(id).value);
  return Number.isFinite(value) ? value : fallback;
}

// ---- Markdown, from text that is escaped first: nothing the model writes becomes markup

function escapeHtml(text) {
  return text.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;")
    .replace(/"/g, "&quot;").replace(/'/g, "&#39;");
}

function inline(text) {
  const codes = [];
  text = text.replace(/`([^`\n]+)`/g, (_, code) => {
    codes.push(code);
    return "\u0000" + (codes.length - 1) + "\u0000";
  });
  text = text
    .replace(/\*\*([^*\n]+)\*\*/g, "<strong>$1</strong>")
    .replace(/(^|[^*])\*([^*\n]+)\*/g, "$1<em>$2</em>")
    .replace(/\[([^\]\n]+)\]\((https?:\/\/[^\s)]+)\)/g,
             '<a href="$2" rel="noopener noreferrer" target="_blank">$1</a>');
  return text.replace(/\u0000(\d+)\u0000/g, (_, i) => "<code>" + codes[+i] + "</code>");
}

function markdown(source) {
  const lines = escapeHtml(source).split("\n");
  const out = [];
  let list = null;
  let paragraph = [];
  const flush = () => {
    if (paragraph.length) out.push("<p>" + paragraph.map(inline).join("<br>") + "</p>");
    paragraph = [];
    if (list) out.push("</" + list + ">");
    list = null;
  };
  for (let i = 0; i < lines.length; i++) {
    const line = lines[i];
    const fence = line.match(/^\s*```\s*([\w+-]*)/);
    if (fence) {
      flush();
      const code = [];
      for (i++; i < lines.length && !/^\s*```/.test(lines[i]); i++) code.push(lines[i]);
      out.push('<div class="code"><button type="button" class="copy">Copy</button>' +
               "<pre><code>" + code.join("\n") + "</code></pre></div>");
      continue;
    }
    const heading = line.match(/^(#{1,6})\s+(.*)$/);
    const item = line.match(/^\s*(?:([-*+])|(\d+)[.)])\s+(.*)$/);
    if (heading) {
      flush();
      const level = Math.min(heading[1].length + 2, 6);
      out.push("<h" + level + ">" + inline(heading[2]) + "</h" + level + ">");
    } else if (item) {
      const kind = item[1] ? "ul" : "ol";
      if (paragraph.length || list !== kind) flush();
      if (!list) { out.push("<" + kind + ">"); list = kind; }
      out.push("<li>" + inline(item[3]) + "</li>");
    } else if (!line.trim()) {
      flush();
    } else {
      if (list) flush();
      paragraph.push(line);
    }
  }
  flush();
  return out.join("");
}

// ---- the conversation on the page

function renderList() {
  const list = $("conversations");
  list.replaceChildren();
  for (const c of conversations) {
    const li = document.createElement("li");
    const open = document.createElement("button");
    open.type = "button";
    open.className = "open" + (c.id === current ? " current" : "");
    open.textContent = c.title;
    open.addEventListener("click", () => {
      current = c.id;
      save();
      render();
      closeSidebar();
    });
    const remove = document.createElement("button");
    remove.type = "button";
    remove.className = "remove";
    remove.setAttribute("aria-label", "Delete " + c.title);
    remove.textContent = "\u00d7";
    remove.addEventListener("click", () => {
      conversations = conversations.filter((other) => other !== c);
      if (current === c.id) current = conversations.length ? conversations[0].id : null;
      save();
      render();
    });
    li.append(open, remove);
    list.append(li);
  }
}

function messageElement(message) {
  const box = document.createElement("article");
  box.className = "message " + message.role;
  box.setAttribute("aria-label", message.role === "user" ? "You" : "Model");
  fill(box, message);
  return box;
}

function fill(box, message) {
  box.replaceChildren();
  if (message.reasoning) {
    const details = document.createElement("details");
    const summary = document.createElement("summary");
    summary.textContent = "Reasoning";
    const thought = document.createElement("div");
    thought.className = "reasoning";
    thought.textContent = message.reasoning;
    details.append(summary, thought);
    box.append(details);
  }
  const body = document.createElement("div");
  body.className = "content";
  if (message.role === "user") body.textContent = message.content;
  else body.innerHTML = markdown(message.content || "");
  box.append(body);
  if (message.error) {
    const error = document.createElement("div");
    error.className = "error";
    error.setAttribute("role", "alert");
    error.textContent = message.error;
    box.append(error);
  }
  if (message.stats) {
    const stats = document.createElement("div");
    stats.className = "stats";
    stats.textContent = message.stats;
    box.append(stats);
  }
  box.dataset.state = message.state || "done";
}

function render() {
  renderList();
  const messages = $("messages");
  messages.replaceChildren();
  const c = conversations.find((other) => other.id === current);
  for (const message of c ? c.messages : []) messages.append(messageElement(message));
  messages.scrollTop = messages.scrollHeight;
}

// ---- talking to the server

async function loadModel() {
  try {
    const response = await fetch("/v1/models", { headers: headers() });
    if (response.status === 401) {
      $("model-info").textContent = "This server needs an API key: enter it in Settings.";
      showSettings(true);
      $("api-key").focus();
      return;
    }
    const card = (await response.json()).data[0];
    model = card.id;
    $("model-info").textContent = card.id +
      (card.max_model_len ? " \u00b7 context " + card.max_model_len + " tokens" : "");
  } catch (error) {
    $("model-info").textContent = "The server does not answer: " + error.message;
  }
}

async function errorText(response) {
  try {
    const body = await response.json();
    return response.status + ": " + (body.error ? body.error.message : JSON.stringify(body));
  } catch (_) {
    return "HTTP " + response.status;
  }
}

async function send(text) {
  const c = conversation();
  if (!c.messages.length) c.title = text.slice(0, 40);
  c.messages.push({ role: "user", content: text });
  const answer = { role: "assistant", content: "", reasoning: "", state: "streaming" };
  c.messages.push(answer);
  save();
  render();
  const box = $("messages").lastElementChild;
  const system = $("system-prompt").value.trim();
  const history = c.messages.slice(0, -1).filter((m) => !m.error || m.content)
    .map((m) => ({ role: m.role, content: m.content }));
  const body = {
    model: model || undefined,
    messages: (system ? [{ role: "system", content: system }] : []).concat(history),
    stream: true,
    stream_options: { include_usage: true },
    temperature: number("temperature", 0.7),
    top_p: number("top-p", 1),
    max_tokens: Math.round(number("max-tokens", 1024)),
  };
  running = new AbortController();
  $("send").hidden = true;
  $("stop").hidden = false;
  const start = performance.now();
  let first = null;
  let tokens = 0;
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: running.signal,
    });
    if (!response.ok) throw new Error(await errorText(response));
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let pending = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      pending += decoder.decode(value, { stream: true });
      const events = pending.split("\n\n");
      pending = events.pop();
      for (const event of events) {
        const data = event.split("\n").filter((l) => l.startsWith("data: "))
          .map((l) => l.slice(6)).join("\n");
        if (!data || data === "[DONE]") continue;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        if (chunk.usage) tokens = chunk.usage.completion_tokens;
        const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
        if (!delta) continue;
        if ((delta.content || delta.reasoning_content) && first === null) {
          first = performance.now();
        }
        answer.content += delta.content || "";
        answer.reasoning += delta.reasoning_content || "";
        fill(box, answer);
        $("messages").scrollTop = $("messages").scrollHeight;
      }
    }
  } catch (error) {
    if (error.name === "AbortError") answer.error = "Stopped.";
    else answer.error = error.message;
  } finally {
    const end = performance.now();
    if (first !== null) {
      const rate = tokens > 1 ? (tokens - 1) / ((end - first) / 1000) : 0;
      answer.stats = (tokens ? tokens + " tokens \u00b7 " : "") +
        (rate ? rate.toFixed(1) + " tokens/s \u00b7 " : "") +
        "first token in " + ((first - start) / 1000).toFixed(2) + " s";
    }
    answer.state = "done";
    fill(box, answer);
    running = null;
    $("send").hidden = false;
    $("stop").hidden = true;
    save();
    renderList();
  }
}

// ---- wiring

function showSettings(open) {
  $("settings").hidden = !open;
  $("toggle-settings").setAttribute("aria-expanded", String(open));
}

$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || running) return;
  $("prompt").value = "";
  send(text);
});
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    $("composer").requestSubmit();
  }
});
$("stop").addEventListener("click", () => { if (running) running.abort(); });
$("new-chat").addEventListener("click", () => {
  current = null;
  conversation();
  save();
  render();
  closeSidebar();
  $("prompt").focus();
});
$("toggle-settings").addEventListener("click", () => showSettings($("settings").hidden));
function closeSidebar() {
  document.body.classList.remove("sidebar-open");
  $("toggle-sidebar").setAttribute("aria-expanded", "false");
}
$("toggle-sidebar").addEventListener("click", () => {
  const open = document.body.classList.toggle("sidebar-open");
  $("toggle-sidebar").setAttribute("aria-expanded", String(open));
});
for (const id of FIELDS) $(id).addEventListener("change", saveSettings);
$("api-key").addEventListener("change", loadModel);
$("messages").addEventListener("click", (event) => {
  if (!event.target.classList.contains("copy")) return;
  const code = event.target.parentElement.querySelector("code").textContent;
  navigator.clipboard.writeText(code).then(() => {
    event.target.textContent = "Copied";
    setTimeout(() => { event.target.textContent = "Copy"; }, 1500);
  }, () => { event.target.textContent = "Copy failed"; });
});

loadSettings();
for (const c of conversations) {  // an answer cut by closing the page
  for (const m of c.messages) {
    if (m.state === "streaming") { m.state = "done"; m.error = "Interrupted."; }
  }
}
if (!conversations.some((c) => c.id === current)) {
  current = conversations.length ? conversations[0].id : null;
}
render();
loadModel();
