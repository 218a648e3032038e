"""The Text-to-SQL recipe's task and reward, with no server: the generated database (three
related tables) and questions, single-table and join, the held-out split, and
execution-based scoring."""

from __future__ import annotations

import text_to_sql_rl as recipe


def test_split_is_disjoint_and_every_reference_returns_rows():
    conn = recipe.build_database(0)
    train, test = recipe.make_questions(conn, 0, 0.3)
    assert len(train) > 100 and len(test) > 40
    assert not {i["sql"] for i in train} & {i["sql"] for i in test}  # no held-out query is trained on
    for item in train + test:
        assert item["result"] and recipe.run_query(conn, item["sql"]) == item["result"]
    assert recipe.make_questions(recipe.build_database(0), 0, 0.3) == (train, test)  # deterministic
    # Joins are on both sides of the split, with an aggregate among them on each side.
    for split in (train, test):
        joins = [i for i in split if recipe.is_join(i)]
        assert len(joins) > 20 and any(
            "COUNT(*)" in i["sql"] or "AVG(" in i["sql"] or "MAX(" in i["sql"] for i in joins
        )
    assert len({i["template"] for i in train + test if recipe.is_join(i)}) >= 6


def test_the_schema_is_three_related_tables():
    conn = recipe.build_database(0)
    tables = sorted(r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'"))
    assert tables == ["departments", "employees", "projects"]
    departments = {name for (name,) in conn.execute("SELECT name FROM departments")}
    assert departments == set(recipe.DEPARTMENTS)
    for table in ("employees", "projects"):  # every row names a department that exists
        assert {d for (d,) in conn.execute(f"SELECT department FROM {table}")} <= departments
    assert conn.execute("SELECT COUNT(*) FROM employees").fetchone() == (64,)
    assert conn.execute("SELECT COUNT(*) FROM projects").fetchone() == (len(recipe.PROJECTS),)
    # The employees are those of a seed alone: the other tables are drawn after them.
    assert (
        recipe.build_database(1).execute("SELECT * FROM employees").fetchall()
        != conn.execute("SELECT * FROM employees").fetchall()
    )


def test_join_references_equal_a_computation_in_python():
    """Each join template's reference result, recomputed from the rows without SQL joins."""
    conn = recipe.build_database(0)
    employees = conn.execute("SELECT name, department, city, salary, age FROM employees").fetchall()
    floor_of = dict(conn.execute("SELECT name, floor FROM departments").fetchall())
    budget_of = dict(conn.execute("SELECT name, budget FROM departments").fetchall())
    runs = dict(conn.execute("SELECT title, department FROM projects").fetchall())
    train, test = recipe.make_questions(conn, 0, 0.3)
    checked = set()
    for item in train + test:
        sql = item["sql"]
        if "d.floor = " in sql and sql.startswith("SELECT p.title"):
            floor = int(sql.split("d.floor = ")[1].rstrip(";"))
            expected = sorted((t,) for t, d in runs.items() if floor_of[d] == floor)
        elif "d.floor = " in sql:
            floor = int(sql.split("d.floor = ")[1].rstrip(";"))
            rows = [e for e in employees if floor_of[e[1]] == floor]
            expected = (
                [(len(rows),)]
                if "COUNT" in sql
                else [(round(sum(e[3] for e in rows) / len(rows), 4),)]
                if "AVG" in sql
                else sorted((e[0],) for e in rows)
            )
        elif "d.budget > " in sql:
            city, budget = sql.split("e.city = '")[1].split("'")[0], int(sql.split("d.budget > ")[1].rstrip(";"))
            expected = [(sum(1 for e in employees if e[2] == city and budget_of[e[1]] > budget),)]
        elif "p.title = " in sql:
            rows = [e for e in employees if e[1] == runs[sql.split("p.title = '")[1].split("'")[0]]]
            expected = [(len(rows),)] if "COUNT" in sql else [(max(e[3] for e in rows),)]
        else:
            continue
        assert item["result"] == expected, sql
        checked.add(item["template"])
    assert len(checked) == 7  # every join template


def test_reward_executes_the_query():
    conn = recipe.build_database(0)
    item = next(i for i in recipe.make_questions(conn, 0, 0.3)[1] if "COUNT(*)" in i["sql"])
    completion = item["sql"][len("SELECT") :]  # the prompt ends with "SELECT"
    assert recipe.reward(conn, item, completion) == (1.1, True)
    # Same result set written differently: still right (the reward compares results, not text).
    assert recipe.reward(conn, item, completion.replace("COUNT(*)", "count(1)"))[1]
    assert recipe.reward(conn, item, " COUNT(*) FROM employees;") == (0.1, False)  # runs, wrong rows
    assert recipe.reward(conn, item, " COUNT(*) FROM nowhere;") == (0.0, False)
    assert recipe.reward(conn, item, completion.rstrip(";")) == (1.0, True)  # no closing ';': no format bonus


def test_order_of_rows_does_not_matter_and_runaway_queries_stop():
    conn = recipe.build_database(0)
    item = {"result": recipe.run_query(conn, "SELECT name FROM employees WHERE age > 40;")}
    assert recipe.reward(conn, item, " name FROM employees WHERE age > 40 ORDER BY name DESC;")[1]
    runaway = " COUNT(*) FROM employees a, employees b, employees c, employees d, employees e;"
    assert recipe.run_query(conn, "SELECT" + runaway) is None


def test_accuracy_is_reported_over_joins_and_single_table_questions_apart():
    items = [
        {"sql": "SELECT COUNT(*) FROM employees e JOIN departments d ON e.department = d.name;"},
        {"sql": "SELECT name FROM employees;"},
        {"sql": "SELECT COUNT(*) FROM projects;"},
    ]
    assert recipe.accuracies(items, [True, False, True]) == {"all": 2 / 3, "join": 1.0, "single_table": 0.5}
    assert recipe.accuracies(items[1:], [False, False]) == {"all": 0.0, "join": None, "single_table": 0.0}
