// A small Markdown renderer for the chat page: fenced code blocks, inline code, headings,
// lists, block quotes, bold, italics, links and paragraphs. The text is HTML-escaped first,
// so a model's answer can never inject markup; links keep only http(s) and mailto targets.
// An unclosed code fence (an answer still streaming) is rendered as a code block so far.
"use strict";

const Markdown = (() => {
  function escapeHtml(text) {
    return text.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;")
      .replace(/"/g, "&quot;").replace(/'/g, "&#39;");
  }

  // Inline spans of one escaped line. Code spans are cut out first so that nothing inside
  // them is read as emphasis or links.
  function inline(text) {
    const codes = [];
    let out = text.replace(/`([^`]+)`/g, (_, code) => {
      codes.push(code);
      return `\u0000${codes.length - 1}\u0000`;
    });
    out = out.replace(/\[([^\]]+)\]\(((?:https?:\/\/|mailto:)[^\s)]+)\)/g,
      (_, label, url) => `<a href="${url}" target="_blank" rel="noopener noreferrer">${label}</a>`);
    out = out.replace(/\*\*([^*]+)\*\*/g, "<strong>$1</strong>");
    out = out.replace(/__([^_]+)__/g, "<strong>$1</strong>");
    out = out.replace(/(^|[^*])\*([^*\s][^*]*)\*/g, "$1<em>$2</em>");
    out = out.replace(/(^|\W)_([^_\s][^_]*)_(?=\W|$)/g, "$1<em>$2</em>");
    out = out.replace(/~~([^~]+)~~/g, "<del>$1</del>");
    return out.replace(/\u0000(\d+)\u0000/g, (_, i) => `<code>${codes[Number(i)]}</code>`);
  }

  function codeBlock(lang, lines) {
    const cls = lang ? ` class="language-${lang}"` : "";
    const label = lang ? `<span class="code-lang">${lang}</span>` : "";
    return `<div class="code-block"><div class="code-head">${label}` +
      `<button type="button" class="copy-code">Copy</button></div>` +
      `<pre><code${cls}>${lines.join("\n")}</code></pre></div>`;
  }

  function render(source) {
    const lines = escapeHtml(source.replace(/\r\n?/g, "\n")).split("\n");
    const html = [];
    let paragraph = [];
    let list = null; // {tag: "ul" | "ol", items: []}
    let quote = [];

    const flushParagraph = () => {
      if (paragraph.length) html.push(`<p>${paragraph.map(inline).join("<br>")}</p>`);
      paragraph = [];
    };
    const flushList = () => {
      if (list) {
        const items = list.items.map((item) => `<li>${inline(item)}</li>`).join("");
        html.push(`<${list.tag}>${items}</${list.tag}>`);
      }
      list = null;
    };
    const flushQuote = () => {
      if (quote.length) html.push(`<blockquote>${render(unescape(quote.join("\n")))}</blockquote>`);
      quote = [];
    };
    const flushAll = () => { flushParagraph(); flushList(); flushQuote(); };

    for (let i = 0; i < lines.length; i++) {
      const line = lines[i];
      const fence = line.match(/^\s*```\s*([\w+#.-]*)\s*$/);
      if (fence) {
        flushAll();
        const body = [];
        i++;
        while (i < lines.length && !/^\s*```\s*$/.test(lines[i])) body.push(lines[i++]);
        html.push(codeBlock(fence[1], body));
        continue;
      }
      const quoted = line.match(/^&gt;\s?(.*)$/);
      if (quoted) { flushParagraph(); flushList(); quote.push(quoted[1]); continue; }
      flushQuote();
      if (/^\s*$/.test(line)) { flushParagraph(); flushList(); continue; }
      const heading = line.match(/^(#{1,6})\s+(.*)$/);
      if (heading) {
        flushAll();
        const level = heading[1].length;
        html.push(`<h${level}>${inline(heading[2])}</h${level}>`);
        continue;
      }
      if (/^\s*([-*_])(\s*\1){2,}\s*$/.test(line)) { flushAll(); html.push("<hr>"); continue; }
      const bullet = line.match(/^\s*[-*+]\s+(.*)$/);
      const numbered = line.match(/^\s*\d+[.)]\s+(.*)$/);
      if (bullet || numbered) {
        flushParagraph();
        const tag = bullet ? "ul" : "ol";
        if (!list || list.tag !== tag) { flushList(); list = { tag, items: [] }; }
        list.items.push((bullet || numbered)[1]);
        continue;
      }
      if (list && /^\s+\S/.test(line)) { // a continuation of the last list item
        list.items[list.items.length - 1] += " " + line.trim();
        continue;
      }
      flushList();
      paragraph.push(line);
    }
    flushAll();
    return html.join("\n");
  }

  // Block quotes are rendered recursively from their (already escaped) text.
  function unescape(text) {
    return text.replace(/&lt;/g, "<").replace(/&gt;/g, ">").replace(/&quot;/g, '"')
      .replace(/&#39;/g, "'").replace(/&amp;/g, "&");
  }

  return { render, escapeHtml };
})();
