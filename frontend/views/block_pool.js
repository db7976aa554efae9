// The block pool as one canvas: thousands of cells stay smooth, and only changed cells travel.
// Python calls reset(full) once per resync and apply(changes) per tick; hover and click go back
// as events ("hover" asks Python for the tooltip text, which it sends with tip()).
const FLASH_MS = 900;
const SHARED = 1, DRAFT = 2, PICKED = 4; // bits of a cell's marks (block_pool.py)
const DIMMED = 0.3; // opacity of the blocks of other requests while one is selected
// Block numbers are drawn only as large as a reader can read them (projector mode: 16 px, the
// page's smallest type there); in smaller cells the hover tooltip names the block instead.
const MIN_NUMBER_PX = 11, PROJECTOR_NUMBER_PX = 16;
// Pools of one scale group (side by side) share one scale, bytes per px²: the scale that lets every
// member fit its canvas. A pool of fewer bytes is then drawn smaller, equal area meaning equal bytes.
const SCALE_GROUPS = new Map(); // group name -> Set of components
// A lesson's ring is at least this wide, centred on its cell: 2,048 blocks make 5 px cells, and a
// ring that small is not seen from the back of a room.
const MIN_RING_PX = 16;

export default {
  template: `<div style="position:relative;width:100%;height:100%">
      <canvas ref="canvas" style="width:100%;height:100%;display:block;cursor:pointer"></canvas>
      <div ref="tip" class="kv-tip" style="position:absolute;display:none;pointer-events:none;z-index:10"></div>
    </div>`,
  // palette and colors: frontend/palette.py; first: the number of this canvas's block 0 (a disaggregated
  // run's instances each draw their own pool, numbered apart): every block number in or out is a global one
  props: { palette: Array, colors: Object, scaleGroup: String, first: { type: Number, default: 0 } },
  mounted() {
    this.n = 0;
    this.cells = { state: new Uint8Array(0), color: new Int16Array(0), marks: new Uint8Array(0) };
    this.dimOthers = false; // a request is selected: its blocks outlined, the others dimmed
    this.flashes = new Map(); // block -> [color, start time]
    this.hover = -1;
    this.focused = new Set(); // blocks lesson mode points at: a lasting double ring
    this.dirty = new Set(); // blocks to repaint at the next frame
    this.all = false; // repaint everything (after a reset or a resize)
    this.frame = null;
    this.geom = { cell: 10, cols: 1 };
    this.bytesPerBlock = 0; // from reset(): 0 for a run without a KV cache, which keeps out of its scale group
    this.fitScale = 0; // the bytes per px² at which this pool just fills its canvas
    if (this.scaleGroup) {
      if (!SCALE_GROUPS.has(this.scaleGroup)) SCALE_GROUPS.set(this.scaleGroup, new Set());
      SCALE_GROUPS.get(this.scaleGroup).add(this);
    }
    const canvas = this.$refs.canvas;
    canvas.addEventListener("mousemove", (e) => this.onMove(e));
    canvas.addEventListener("mouseleave", () => this.onLeave());
    canvas.addEventListener("click", (e) => {
      const b = this.blockAt(e);
      if (b >= 0) this.$emit("pick", { block: b + this.first });
    });
    this.resizeObserver = new ResizeObserver(() => this.layout());
    this.resizeObserver.observe(this.$el);
    this.onProjector = () => this.layout();
    window.addEventListener("kvscope-projector", this.onProjector);
  },
  unmounted() {
    SCALE_GROUPS.get(this.scaleGroup)?.delete(this);
    this.resizeObserver?.disconnect();
    window.removeEventListener("kvscope-projector", this.onProjector);
    if (this.frame) cancelAnimationFrame(this.frame);
  },
  methods: {
    probe(meta) {
      if (!meta || !window.kvscope) return;
      if (meta.stamp) kvscope.lat(meta.stamp[0], meta.stamp[1]);
      if (meta.ack !== undefined) kvscope.painted(meta.ack);
    },
    reset(full, meta) {
      this.probe(meta);
      this.n = full.state.length;
      this.cells = { state: Uint8Array.from(full.state), color: Int16Array.from(full.color),
                     marks: Uint8Array.from(full.marks) };
      this.dimOthers = !!full.focus;
      if (this.$refs.canvas) this.$refs.canvas.dataset.dimmed = this.dimOthers ? "others" : ""; // for a test
      this.bytesPerBlock = full.bytes_per_block || 0;
      this.flashes.clear();
      this.layout();
    },
    apply(changes, meta) {
      this.probe(meta);
      const now = performance.now();
      for (const [g, state, color, marks, flash] of changes) {
        const b = g - this.first;
        if (b < 0 || b >= this.n) continue;
        this.cells.state[b] = state;
        this.cells.color[b] = color;
        this.cells.marks[b] = marks;
        if (flash) this.flashes.set(b, [this.colors.flash[flash] || "#000", now]);
        this.dirty.add(b);
      }
      this.schedule();
    },
    // (a method and a field of one component share one namespace: a field named focus hid this method)
    ring(blocks, color) {
      for (const b of this.focused) this.dirty.add(b);
      this.focused = new Set(blocks.map((g) => g - this.first));
      this.ringColor = color || this.colors.focus; // the colour the lesson's text names (palette.ring_color)
      this.all = true; // a ring larger than its cell covers neighbours: repaint them all
      this.$refs.canvas.dataset.ringed = blocks.join(" "); // what a canvas draws, readable by a test or a screen reader
      this.$refs.canvas.dataset.ringColor = this.ringColor;
      this.schedule();
    },
    tip(block, html) {
      if (block !== this.hover + this.first) return;
      this.$refs.tip.innerHTML = html;
      this.$refs.tip.style.display = "block";
    },
    layout() {
      const canvas = this.$refs.canvas;
      const w = this.$el.clientWidth, h = this.$el.clientHeight;
      if (!w || !h) return;
      const dpr = window.devicePixelRatio || 1;
      canvas.width = Math.round(w * dpr);
      canvas.height = Math.round(h * dpr);
      const n = Math.max(this.n, 1);
      let cell = Math.min(44, Math.floor(Math.sqrt((w * h) / n)));
      while (cell > 3 && Math.floor(w / cell) * Math.floor(h / cell) < n) cell--;
      const fitCols = Math.max(1, Math.floor(w / Math.max(cell, 2)));
      cell = this.scaled(cell); // drawn smaller, the grid keeps its shape: the same columns, smaller cells
      const projector = document.documentElement.classList.contains("kv-projector");
      const font = Math.min(Math.floor(cell * 0.42), 20); // "2047" fits a cell at this size
      const numbers = font >= (projector ? PROJECTOR_NUMBER_PX : MIN_NUMBER_PX) ? font : 0;
      this.geom = { cell: Math.max(cell, 2), cols: fitCols, dpr, numbers, ring: Math.max(cell, MIN_RING_PX) };
      Object.assign(canvas.dataset, { cell: this.geom.cell, blocks: this.n, bytesPerBlock: this.bytesPerBlock });
      this.all = true;
      this.schedule();
    },
    // The cell side at the group's common scale: the largest bytes per px² any member needs to fit, so
    // a cell's area is its bytes over that scale (not rounded to whole pixels: areas stay in proportion).
    scaled(fitCell) {
      const group = SCALE_GROUPS.get(this.scaleGroup);
      if (!group || !this.bytesPerBlock) return fitCell;
      const before = this.commonScale(group);
      this.fitScale = this.bytesPerBlock / (fitCell * fitCell);
      const common = this.commonScale(group);
      if (common !== before) for (const other of group) if (other !== this && other.bytesPerBlock) other.layout();
      return Math.sqrt(this.bytesPerBlock / common);
    },
    commonScale(group) {
      return Math.max(0, ...[...group].map((c) => (c.bytesPerBlock ? c.fitScale : 0)));
    },
    schedule() {
      if (!this.frame) this.frame = requestAnimationFrame(() => this.draw());
    },
    // Only the cells that changed, flash or are hovered are repainted: with 2,048 blocks a full
    // repaint every animation frame would keep the CPU busy for as long as anything flashes.
    draw() {
      this.frame = null;
      const ctx = this.$refs.canvas.getContext("2d");
      const { cell, dpr, numbers } = this.geom;
      ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
      ctx.font = `600 ${numbers}px sans-serif`;
      ctx.textAlign = "center";
      ctx.textBaseline = "middle";
      const now = performance.now();
      if (this.all) {
        ctx.clearRect(0, 0, this.$refs.canvas.width, this.$refs.canvas.height);
        for (let b = 0; b < this.n; b++) this.drawCell(ctx, b, now);
        this.all = false;
      } else {
        for (const b of this.dirty) this.drawCell(ctx, b, now);
        for (const b of this.flashes.keys()) if (!this.dirty.has(b)) this.drawCell(ctx, b, now);
      }
      this.dirty.clear();
      for (const b of this.focused) this.drawRing(ctx, b); // on top: a repainted neighbour cleared its overhang
      if (this.flashes.size) this.schedule();
    },
    drawCell(ctx, b, now) {
      if (b < 0 || b >= this.n) return;
      const { cell, cols } = this.geom;
      const pal = this.palette;
      const x = (b % cols) * cell, y = Math.floor(b / cols) * cell;
      const gap = cell / 16; // in proportion: pools drawn to one scale keep their painted areas in proportion too
      const state = this.cells.state[b];
      ctx.clearRect(x, y, cell, cell);
      const marks = this.cells.marks[b];
      const dim = this.dimOthers && state === 1 && !(marks & PICKED);
      ctx.globalAlpha = dim ? DIMMED : 1;
      ctx.fillStyle = state === 1 ? pal[this.cells.color[b] % pal.length] : state === 2 ? this.colors.cached : this.colors.free;
      ctx.fillRect(x + gap, y + gap, cell - 2 * gap, cell - 2 * gap);
      if (marks & DRAFT) { // white stripes: the draft model's own KV
        ctx.save();
        ctx.beginPath();
        ctx.rect(x + gap, y + gap, cell - 2 * gap, cell - 2 * gap);
        ctx.clip();
        ctx.strokeStyle = "rgba(255,255,255,0.75)";
        ctx.lineWidth = Math.max(1, cell / 10);
        for (let d = -cell; d < cell; d += Math.max(3, cell / 4)) {
          ctx.beginPath();
          ctx.moveTo(x + d, y + cell);
          ctx.lineTo(x + d + cell, y);
          ctx.stroke();
        }
        ctx.restore();
      }
      if (marks & SHARED) { // a dark corner: more than one sequence reads this block
        ctx.fillStyle = this.colors.shared;
        ctx.beginPath();
        ctx.moveTo(x + cell - gap, y + gap);
        ctx.lineTo(x + cell - gap, y + gap + cell * 0.45);
        ctx.lineTo(x + cell - gap - cell * 0.45, y + gap);
        ctx.fill();
      }
      if (this.geom.numbers) {
        ctx.fillStyle = state === 1 ? "#fff" : "#64748b";
        ctx.fillText(String(b + this.first), x + cell / 2, y + cell / 2);
      }
      ctx.globalAlpha = 1;
      if (marks & PICKED) { // the selected request's block
        ctx.strokeStyle = this.colors.shared;
        ctx.lineWidth = Math.max(1.5, cell / 8);
        ctx.strokeRect(x + gap + 0.75, y + gap + 0.75, cell - 2 * gap - 1.5, cell - 2 * gap - 1.5);
      }
      const flash = this.flashes.get(b);
      if (flash) {
        const age = (now - flash[1]) / FLASH_MS;
        if (age >= 1) {
          this.flashes.delete(b);
        } else { // a ring inside the cell, fading out
          const width = Math.max(1.5, cell / 4) * (1 - age * 0.5);
          ctx.globalAlpha = 1 - age;
          ctx.strokeStyle = flash[0];
          ctx.lineWidth = width;
          ctx.strokeRect(x + width / 2, y + width / 2, cell - width, cell - width);
          ctx.globalAlpha = 1;
        }
      }
      if (b === this.hover) {
        ctx.strokeStyle = "#111";
        ctx.lineWidth = 2;
        ctx.strokeRect(x + 1, y + 1, cell - 2, cell - 2);
      }
    },
    // The lesson's double ring (its colour outside, white inside) around block b, `ring` px across.
    drawRing(ctx, b) {
      if (b < 0 || b >= this.n) return;
      const { cell, cols, ring } = this.geom;
      const inside = (v) => Math.max(0, v); // a ring at the pool's edge stays on the canvas
      const x = Math.min(inside((b % cols) * cell + (cell - ring) / 2), inside(cols * cell - ring));
      const y = inside(Math.floor(b / cols) * cell + (cell - ring) / 2);
      const w = Math.max(3, ring / 8);
      ctx.lineWidth = w;
      ctx.strokeStyle = this.ringColor || this.colors.focus;
      ctx.strokeRect(x + w / 2, y + w / 2, ring - w, ring - w);
      ctx.strokeStyle = "#fff";
      ctx.lineWidth = Math.max(1, w / 2);
      ctx.strokeRect(x + w * 1.25, y + w * 1.25, ring - w * 2.5, ring - w * 2.5);
    },
    blockAt(e) {
      const r = this.$refs.canvas.getBoundingClientRect();
      const { cell, cols } = this.geom;
      const col = Math.floor((e.clientX - r.left) / cell), row = Math.floor((e.clientY - r.top) / cell);
      if (col < 0 || col >= cols) return -1;
      const b = row * cols + col;
      return b >= 0 && b < this.n ? b : -1;
    },
    onMove(e) {
      const b = this.blockAt(e);
      const tip = this.$refs.tip;
      const r = this.$el.getBoundingClientRect();
      const left = e.clientX - r.left + 14, top = e.clientY - r.top + 14;
      tip.style.left = `${Math.min(left, r.width - 220)}px`;
      tip.style.top = `${Math.min(top, r.height - 60)}px`;
      if (b === this.hover) return;
      this.dirty.add(this.hover);
      this.hover = b;
      this.dirty.add(b);
      tip.style.display = "none";
      if (b >= 0) this.$emit("hover", { block: b + this.first });
      this.schedule();
    },
    onLeave() {
      this.dirty.add(this.hover);
      this.hover = -1;
      this.$refs.tip.style.display = "none";
      this.schedule();
    },
  },
};
