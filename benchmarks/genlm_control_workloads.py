"""Prompts and regexes of the genlm-control benchmark (``genlm_control_driver.py``).

* ``email``: a one-turn chat prompt (about 50 tokens) asking for an email address,
  constrained by an email regex.
* ``sql``: a text-to-SQL few-shot chat prompt (about 1,500 tokens with the
  SmolLM2 tokenizer): a system text, three examples (a ``CREATE TABLE`` schema of
  several tables and a question; the answer as the assistant's turn), then the
  target schema and question. The answer is constrained to a small SQL subset:
  one table, an optional ``WHERE`` comparison, ``ORDER BY`` and ``LIMIT``.

``WORKLOADS[name]`` is ``(chat messages, regex)``; ``CRITICS[name]`` is the prompt of
the LLM critic of ``--critic`` runs (the particle's text follows it).
"""

from __future__ import annotations

EMAIL_REQUEST = (
    "Make up a work email address for Jane Doe, who works at Example Corp. "
    "Answer with the address only."
)
EMAIL_REGEX = r"[a-z]{2,12}\.[a-z]{2,12}@[a-z]{3,12}\.(com|org|net)"

SQL_SYSTEM = """\
You are a careful data analyst who writes SQL for a SQLite database. You are given \
the schema of a database as CREATE TABLE statements, followed by a question asked by \
a colleague who does not know SQL. Answer with exactly one SQL query and nothing else: \
no explanation, no comments, no Markdown fences. The query reads a single table. Use \
only the columns that exist in that table, spelled exactly as in the schema. Write SQL \
keywords in upper case and identifiers in lower case. Compare text columns with string \
literals in single quotes and numeric columns with plain numbers. When the question asks \
for the largest, latest or most of something, sort in descending order; when it asks for \
a fixed number of rows, add a LIMIT clause. Do not join tables, do not use aggregate \
functions, subqueries or column aliases, and do not filter on more than one condition. \
If the question names a category, genre, region or status, copy its spelling as a \
colleague would type it. End the query with a semicolon."""

SQL_EXAMPLES = [
    (
        """\
CREATE TABLE customers (
    customer_id INTEGER PRIMARY KEY,
    first_name TEXT NOT NULL,
    last_name TEXT NOT NULL,
    email TEXT UNIQUE,
    city TEXT,
    country TEXT,
    signup_date DATE,
    loyalty_points INTEGER DEFAULT 0
);
CREATE TABLE products (
    product_id INTEGER PRIMARY KEY,
    product_name TEXT NOT NULL,
    category TEXT,
    unit_price REAL NOT NULL,
    units_in_stock INTEGER,
    discontinued INTEGER DEFAULT 0
);
CREATE TABLE orders (
    order_id INTEGER PRIMARY KEY,
    customer_id INTEGER REFERENCES customers(customer_id),
    order_date DATE NOT NULL,
    ship_city TEXT,
    total_amount REAL,
    status TEXT
);
CREATE TABLE order_items (
    order_id INTEGER REFERENCES orders(order_id),
    product_id INTEGER REFERENCES products(product_id),
    quantity INTEGER NOT NULL,
    discount REAL DEFAULT 0
);
CREATE TABLE reviews (
    review_id INTEGER PRIMARY KEY,
    product_id INTEGER REFERENCES products(product_id),
    customer_id INTEGER REFERENCES customers(customer_id),
    rating INTEGER CHECK (rating BETWEEN 1 AND 5),
    review_text TEXT,
    posted_on DATE
);""",
        "Which ten products cost the most? Show their names and prices.",
        "SELECT product_name, unit_price FROM products ORDER BY unit_price DESC LIMIT 10;",
    ),
    (
        """\
CREATE TABLE departments (
    department_id INTEGER PRIMARY KEY,
    department_name TEXT NOT NULL,
    building TEXT,
    budget REAL
);
CREATE TABLE employees (
    employee_id INTEGER PRIMARY KEY,
    first_name TEXT NOT NULL,
    last_name TEXT NOT NULL,
    job_title TEXT,
    department_id INTEGER REFERENCES departments(department_id),
    hire_date DATE,
    salary INTEGER,
    manager_id INTEGER REFERENCES employees(employee_id)
);
CREATE TABLE projects (
    project_id INTEGER PRIMARY KEY,
    project_name TEXT NOT NULL,
    department_id INTEGER REFERENCES departments(department_id),
    start_date DATE,
    end_date DATE,
    status TEXT
);
CREATE TABLE assignments (
    employee_id INTEGER REFERENCES employees(employee_id),
    project_id INTEGER REFERENCES projects(project_id),
    role TEXT,
    hours_per_week INTEGER
);""",
        "List the first and last names of the employees who earn more than 85000 a year.",
        "SELECT first_name, last_name FROM employees WHERE salary > 85000;",
    ),
    (
        """\
CREATE TABLE stations (
    station_id INTEGER PRIMARY KEY,
    station_name TEXT NOT NULL,
    latitude REAL,
    longitude REAL,
    elevation_m INTEGER,
    region TEXT
);
CREATE TABLE daily_readings (
    reading_id INTEGER PRIMARY KEY,
    station_id INTEGER REFERENCES stations(station_id),
    reading_date DATE NOT NULL,
    max_temp_c REAL,
    min_temp_c REAL,
    rainfall_mm REAL,
    wind_speed_kmh REAL
);
CREATE TABLE sensors (
    sensor_id INTEGER PRIMARY KEY,
    station_id INTEGER REFERENCES stations(station_id),
    sensor_type TEXT,
    installed_on DATE,
    last_calibrated DATE
);
CREATE TABLE maintenance_visits (
    visit_id INTEGER PRIMARY KEY,
    station_id INTEGER REFERENCES stations(station_id),
    visit_date DATE NOT NULL,
    technician TEXT,
    work_done TEXT,
    cost_eur REAL
);""",
        "Which stations are in the Highlands region? Give their names and elevations, "
        "highest first.",
        "SELECT station_name, elevation_m FROM stations WHERE region = 'Highlands' "
        "ORDER BY elevation_m DESC;",
    ),
]

SQL_TARGET = (
    """\
CREATE TABLE authors (
    author_id INTEGER PRIMARY KEY,
    full_name TEXT NOT NULL,
    birth_year INTEGER,
    nationality TEXT
);
CREATE TABLE books (
    book_id INTEGER PRIMARY KEY,
    title TEXT NOT NULL,
    author_id INTEGER REFERENCES authors(author_id),
    genre TEXT,
    publication_year INTEGER,
    page_count INTEGER,
    copies_owned INTEGER
);
CREATE TABLE members (
    member_id INTEGER PRIMARY KEY,
    full_name TEXT NOT NULL,
    joined_on DATE,
    home_branch TEXT,
    fines_owed REAL DEFAULT 0
);
CREATE TABLE loans (
    loan_id INTEGER PRIMARY KEY,
    book_id INTEGER REFERENCES books(book_id),
    member_id INTEGER REFERENCES members(member_id),
    loaned_on DATE NOT NULL,
    due_on DATE NOT NULL,
    returned_on DATE
);
CREATE TABLE branches (
    branch_id INTEGER PRIMARY KEY,
    branch_name TEXT NOT NULL,
    street_address TEXT,
    opening_hours TEXT,
    seats INTEGER
);
CREATE TABLE reservations (
    reservation_id INTEGER PRIMARY KEY,
    book_id INTEGER REFERENCES books(book_id),
    member_id INTEGER REFERENCES members(member_id),
    reserved_on DATE NOT NULL,
    pickup_branch TEXT,
    fulfilled INTEGER DEFAULT 0
);""",
    "What are the titles of the five longest books in the science fiction genre?",
)

IDENT = r"[a-z_]{2,20}"
SQL_REGEX = (
    rf"SELECT (\*|{IDENT}(, {IDENT}){{0,4}}) FROM {IDENT}"
    rf"( WHERE {IDENT} (=|<|>) ([0-9]{{1,6}}|'[A-Za-z ]{{1,20}}'))?"
    rf"( ORDER BY {IDENT}( DESC)?)?( LIMIT [0-9]{{1,3}})?;"
)


def _sql_user_turn(schema: str, question: str) -> str:
    return f"Schema:\n{schema}\n\nQuestion: {question}"


def sql_messages() -> list[dict]:
    messages = [{"role": "system", "content": SQL_SYSTEM}]
    for schema, question, answer in SQL_EXAMPLES:
        messages.append({"role": "user", "content": _sql_user_turn(schema, question)})
        messages.append({"role": "assistant", "content": answer})
    messages.append({"role": "user", "content": _sql_user_turn(*SQL_TARGET)})
    return messages


WORKLOADS = {
    "email": ([{"role": "user", "content": EMAIL_REQUEST}], EMAIL_REGEX),
    "sql": (sql_messages(), SQL_REGEX),
}

CRITICS = {
    "email": "A plausible work email address for Jane Doe at Example Corp: ",
    "sql": "A correct SQLite query for the question above, reading one table: ",
}

BESIDE_TEXTS = {  # what the second workload of genlm_control_driver.py --beside asks about
    "email": ["jane.doe@example.com", "jdoe@example.com", "jane@example.com"],
    "sql": [
        "SELECT title FROM books ORDER BY pages DESC LIMIT 5;",
        "SELECT * FROM books WHERE genre = 'science fiction' LIMIT 5;",
        "SELECT title, pages FROM books ORDER BY page_count DESC LIMIT 5;",
    ],
}
