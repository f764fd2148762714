//! The aligned plain-text tables the tools print (demo, benchmarks, fleet simulator).
//!
//! Each column is declared once, with its header, width, alignment and how a row fills it, so
//! a header and its cells cannot drift apart. A line is every cell padded to its column's
//! width (a wider cell pushes the rest of the line right), the cells joined by one space and
//! ended by a newline: what a `format!("{:<12} {:>9}\n", ...)` pair of header and row lines
//! printed before, byte for byte.

/// A table of rows of `R`, its columns added with [`TextTable::left`] and
/// [`TextTable::right`].
pub struct TextTable<'a, R> {
    columns: Vec<Column<'a, R>>,
}

/// One column: header, width, alignment and the cell of a row.
struct Column<'a, R> {
    header: &'a str,
    width: usize,
    left: bool,
    cell: Box<dyn Fn(&R) -> String + 'a>,
}

impl<R> Default for TextTable<'_, R> {
    fn default() -> Self {
        Self::new()
    }
}

impl<'a, R> TextTable<'a, R> {
    /// A table without columns yet.
    pub fn new() -> Self {
        Self {
            columns: Vec::new(),
        }
    }

    /// Adds a left-aligned column (labels: router, policy, workload).
    pub fn left(self, header: &'a str, width: usize, cell: impl Fn(&R) -> String + 'a) -> Self {
        self.column(header, width, true, cell)
    }

    /// Adds a right-aligned column (numbers, so their digits line up).
    pub fn right(self, header: &'a str, width: usize, cell: impl Fn(&R) -> String + 'a) -> Self {
        self.column(header, width, false, cell)
    }

    fn column(
        mut self,
        header: &'a str,
        width: usize,
        left: bool,
        cell: impl Fn(&R) -> String + 'a,
    ) -> Self {
        self.columns.push(Column {
            header,
            width,
            left,
            cell: Box::new(cell),
        });
        self
    }

    /// The header line and one line per row.
    pub fn render<'r>(&self, rows: impl IntoIterator<Item = &'r R>) -> String
    where
        R: 'r,
    {
        let mut out = self.line(|c| c.header.to_string());
        for row in rows {
            out.push_str(&self.line(|c| (c.cell)(row)));
        }
        out
    }

    fn line(&self, text: impl Fn(&Column<'a, R>) -> String) -> String {
        let cells: Vec<String> = self
            .columns
            .iter()
            .map(|c| {
                let (t, w) = (text(c), c.width);
                if c.left {
                    format!("{t:<w$}")
                } else {
                    format!("{t:>w$}")
                }
            })
            .collect();
        cells.join(" ") + "\n"
    }
}

/// A share (0 to 1) as a percentage with one decimal, `12.5%`: how the tables print hit rates
/// and failure rates.
pub fn percent(share: f64) -> String {
    format!("{:.1}%", share * 100.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_are_what_a_header_and_a_row_format_print() {
        let rows = [("a", 1.25), ("longer name", 1234.5)];
        let text = TextTable::new()
            .left("name", 6, |r: &(&str, f64)| r.0.to_string())
            .right("ms", 7, |r| format!("{:.0}ms", r.1))
            .right("x", 3, |r| format!("{:.1}", r.1))
            .render(&rows);
        let mut want = format!("{:<6} {:>7} {:>3}\n", "name", "ms", "x");
        for (n, v) in rows {
            want.push_str(&format!("{n:<6} {v:>5.0}ms {v:>3.1}\n"));
        }
        assert_eq!(text, want);
    }
}
