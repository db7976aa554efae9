// Text (or HTML) that changes many times a second. Python calls set() as a method: an element
// update would make NiceGUI re-render the page's whole virtual DOM; this only sets innerHTML.
export default {
  template: "<div></div>",
  props: { content: String, html: Boolean },
  mounted() {
    this.set(this.content);
  },
  methods: {
    set(content) {
      if (this.html) this.$el.innerHTML = content || "";
      else this.$el.textContent = content || "";
    },
  },
};
